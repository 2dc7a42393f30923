"""Kiln's kernels as TensorRT AOT plugins: the calling convention, checked to the byte without TensorRT.

Nothing here imports tensorrt. This package produces, for each kernel a TensorRT plugin would launch,
PTX whose `.entry` parameter list is exactly what TensorRT passes, checks it (`ptx.check_entry`) and
assembles it with ptxas for each target SM (`ptxas.assemble`). Registering the plugins with
`tensorrt.plugin` (imported lazily, on a TensorRT host) is a later step; no TensorRT call has run here.

What TensorRT's AOT Python plugins pass to a kernel (research, 2026-11-27; read, not copied):
- `@tensorrt.plugin.aot_impl(id)` receives the inputs' TensorDescs, the attributes, `outputs` and the
  tactic, and returns `(kernel_name, ptx, KernelLaunchParams, SymExprs)`; "Presently, only PTX is
  supported"; attributes are not serialized into an AOT engine.
  https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/infer/tensorrt.plugin/trt_plugin_aot_impl/index.html
- The extra kernel arguments are integer symbolic expressions only: `PluginArgType` has just `kINT`,
  `PluginArgDataType` `kINT8/kINT16/kINT32` (NvInferPythonPlugin.h, TensorRT 11.3.0 C++ API,
  https://docs.nvidia.com/deeplearning/tensorrt/11.3.0/_static/c-api/_nv_infer_python_plugin_8h.html).
  No floats, no pointers: a float scalar (eps, softmax scale) must be a constexpr or an input tensor.
- Order: input pointers, then the extra int32 arguments, then output pointers. NVIDIA's samples declare
  kernels that way (`add_kernel(x_ptr, n_elements, y_ptr, BLOCK_SIZE)` with `SymInt32(N)` as the one
  extra arg: NVIDIA/TensorRT samples/python/quickly_deployable_plugins/qdp_defs.py and the
  `aot_impl` docstring), and Torch-TensorRT's `triton_op` states it as the rule: "the kernel's
  non-constexpr parameters must be declared as (input_ptrs..., extra_scalars..., output_ptrs...) so no
  PTX rewriting is needed" (https://docs.pytorch.org/TensorRT/tutorials/_rendered_examples/dynamo/triton_op.html).
- Launch: `KernelLaunchParams.grid_x/y/z` (symbolic, from input shapes), `block_x/y/z`
  (= num_warps * 32 for a Triton kernel; its PTX says `.reqntid`), `shared_mem` (= metadata.shared).
  No cluster dimensions, so a variant with num_ctas != 1 is refused.
- In-place ops: an output declared `inp.aliased()` shares the input's buffer (README of the sample,
  "Implementing in-place custom ops with I/O aliasing"). Assumed, not verified: TensorRT still passes the
  aliased output as its own pointer parameter (so the rope+KV-write kernel declares both).
- Triton 3.7 (this project's) appends two `.u64` pointer parameters to every kernel (global scratch,
  and profile scratch since triton-lang/triton#7258; cf. pytorch/pytorch#159772, which had to pass them). Launchers
  pass null when the compiled sizes are 0. TensorRT passes nothing after the outputs, so they must not
  be declared at all: NVIDIA's own TensorRT-Incubator (tripy) custom-operations guide strips
  unreferenced entry parameters from Triton PTX before returning it from `aot_impl` ("Newer Triton
  versions may add extra kernel entry parameters ... Some plugin launch paths expect only the
  explicitly modeled arguments"; https://nvidia.github.io/TensorRT-Incubator/pre0_user_guides/03-custom-operations.html).

Decision: the plugin PTX declares no scratch parameters. `convention.compile_trt` refuses a variant
whose global or profile scratch size is non-zero (TensorRT could not pass the buffer), and
`ptx.strip_scratch` removes exactly the two trailing Triton pointers after checking that the kernel body
never names them (so removing the declaration cannot change the code; ptxas then proves the result is
well-formed). This is narrower than tripy's workaround, which drops any unreferenced parameter and would
shift the positions of TensorRT's own arguments.

Floats: RMSNorm's eps is baked in as a constexpr per bundle (the compiled code is then the native
kernel's with an immediate); the softmax scale is an fp32[1] input, because as a constexpr 0.125 let
LLVM reorder the decode's q scaling around its fp16 conversion (kernels.py). The tests compare each
plugin's instructions with the natively compiled variant's: equal, plus that scale's one load.

Modules: `kernels` (the TensorRT-order wrappers around the unchanged kernels), `convention` (which
params are inputs / int32 scalars / outputs for each planned variant, compile), `ptx` (entry parser and
checker), `ptxas` (assemble for sm_90a / sm_100a).
"""
