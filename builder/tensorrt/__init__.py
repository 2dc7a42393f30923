"""The TensorRT target of a bundle (``tensorrt.enabled``): the decoder as an ONNX graph whose weights stay
in the bundle's safetensors (``onnx_export``), Kiln's kernels as plugin PTX (plugins/tensorrt/) and the
optimization profiles, all written by the compile stage; the plan itself is built on a TensorRT host
by ``python -m builder.tensorrt_build``. Imports onnx, so only a build that asks for it loads this."""
