"""The runtime core: the engine spec and its errors, KV planning, and the step runners behind the one
forward-pass seam (native, tensor-parallel, ONNX/TensorRT graphs). Importing the package imports
nothing (the pure KV capacity planner is loaded without torch)."""
