"""Kiln's CPU kernels: C (kernels.c) built by the machine's compiler (build.py), called through
ctypes on torch tensors (ops.py). Each gives the bits of its PyTorch reference in
plugins/reference/cpu.py."""
