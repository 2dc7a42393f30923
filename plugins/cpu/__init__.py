"""Kiln's CPU kernels: C (kernels.c, attention.c) built by the machine's compiler (build.py), called
through ctypes on torch tensors (ops.py). The elementwise kernels give the bits of their PyTorch
references in plugins/reference/cpu.py; attention.c gives its own (attention.c's header says how),
float32 rounding apart from the SDPA tiles it replaces."""
