"""Every benchmark and check as data: one row per suite, grouped by the question it answers, and the
GPU host's run as an ordered list of those rows with time budgets.

``python -m harness.perf list`` prints this table; ``python -m harness.perf run NAME`` runs a row;
``python -m harness.perf gpu-host OUT`` runs ``GPU_HOST`` (harness/gpucheck/device.sh calls it). The
make targets name rows of this table, so changing how a benchmark is started happens here only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# the question each group answers, in the order `list` shows them
GROUPS = {
    "check": "does the runtime work on this device (formats, kernels, GPU vs CPU)?",
    "kernels": "how fast is one kernel against the bandwidth or compute it could reach?",
    "step": "what does one engine step cost: host overhead, a decode step, a speculative pass, launches?",
    "throughput": "how many tokens per second does the engine produce, against a reference?",
    "serving": "what does the serving path (Triton, gRPC, the OpenAI front door) add?",
    "build": "how long and how much memory does building an engine take?",
    "grammar": "what does structured output cost per sequence and step?",
    "reliability": "does the server stay correct under long mixed load and cancellation?",
}


@dataclass(frozen=True)
class Suite:
    """One runnable benchmark or check.

    ``entry``: the command after the interpreter (``-m module args``), or a script path with ``script``.
    ``output``: the result's file name in a folder given to the GPU host or ``run --output-dir``
    (None: the suite writes no result file of its own, or names it itself, under build/perf/).
    ``out_flag``: how the suite takes its result path. ``budget_s``: its time limit in a GPU host run,
    and how long it takes at its default size elsewhere. ``make``: the make target that runs it."""
    name: str
    group: str
    device: str                     # "cpu" or "gpu": where it is meant to run
    budget_s: int
    entry: tuple[str, ...]
    about: str
    output: str | None = None
    out_flag: str | None = "--out"
    make: str | None = None
    script: bool = False            # entry[0] is a bash script, not python arguments
    env: dict[str, str] = field(default_factory=dict)


SUITES: tuple[Suite, ...] = (
    # check
    Suite("gpu-check-prepare", "check", "cpu", 120, ("-m", "harness.gpucheck", "prepare"),
          "tiny random-weight bundles of every GPU format and their CPU outputs, into build/gpu-check/",
          out_flag=None, make="gpu-check-prepare"),
    Suite("gpu-check", "check", "gpu", 100, ("-m", "harness.gpucheck", "run"),
          "every prepared format on the GPU: AOT cubins without JIT, triton vs torch, GPU vs CPU vs HF, "
          "the streamed verify on the GPU", output="gpu-check.json", make="gpu-check"),
    Suite("gpu-check-families", "check", "gpu", 90, ("-m", "harness.gpucheck", "run", "--group", "families"),
          "Qwen3, Mistral (window) and Gemma 3 (sliding layers' own KV pool) bundles on the GPU: each attention "
          "backend they run on vs the CPU and transformers' logits", output="gpu-check-families.json"),
    Suite("dtests", "check", "gpu", 60,
          ("-m", "pytest", "tests/kernels/test_paged_decode.py", "-q", "-p", "no:cacheprovider", "-n", "8"),
          "the decode attention's tests on the GPU (every tuning knob against the reference)",
          out_flag=None, env={"KILN_KERNEL_TESTS_ON_GPU": "1", "TRITON_INTERPRET": "0"}),
    # kernels
    Suite("bench-kernels", "kernels", "gpu", 120, ("-m", "harness.perf.kernels.gpu_kernels"),
          "kernel tests on the GPU, decode/prefill/W4A16 bandwidth, small-M FP8 and W4A16 GEMMs, graphed "
          "FP8-KV decode, AOT without JIT", output="kernels.json", make="bench-kernels"),
    Suite("sweep", "kernels", "gpu", 150, ("-m", "harness.perf.kernels.gpu_kernels", "--sweep-only"),
          "every candidate launch configuration of the named plugins.tuning entries", output="sweep.json"),
    Suite("ncu", "kernels", "gpu", 60, ("-m", "harness.perf.kernels.sweep", "ncu", "--case", "fp8-b512-ctx1536"),
          "Nsight Compute on the FP8-KV decode launch (run under ncu by the GPU host)", out_flag=None),
    Suite("cpu-kernels", "kernels", "cpu", 900, ("-m", "harness.perf.kernels.cpu_kernels"),
          "the CPU C kernels on and off in one process, rounds alternating", output="cpu-kernels-ab.json"),
    Suite("cpu-linear", "kernels", "cpu", 300, ("-m", "harness.perf.kernels.cpu_kernels", "linear"),
          "CPU linear paths on SmolLM2 shapes", output="cpu_linear.json"),
    # step
    Suite("host-overhead", "step", "cpu", 600, ("-m", "harness.perf.step.host_overhead"),
          "host time per engine step with a zero-cost stub model (scheduler parts, the whole Executor.step)",
          output="host-overhead.json", out_flag="--output", make="bench-overhead"),
    Suite("host-overhead-gpu-host", "step", "gpu", 25,
          ("-m", "harness.perf.step.host_overhead", "--num-seqs", "512", "--steps", "200"),
          "the GPU host's own time per engine step at 512 sequences, before its throughput run",
          output="host-overhead.json", out_flag="--output"),
    Suite("host-overhead-ab", "step", "cpu", 600, ("-m", "harness.perf.step.overhead_ab", "--base", "HEAD"),
          "another revision's engine host code against this tree's, steps alternating in one process "
          "(--base REV picks the revision)", output="host-overhead-ab.json", out_flag="--output"),
    Suite("decode-perf", "step", "gpu", 70, ("-m", "harness.perf.step.decode_perf", "--batches", "1", "64", "512"),
          "one decode step, fused vs unfused decoder layer, eager and CUDA graph, vs the bandwidth floor",
          output="decode-perf.json"),
    Suite("launches", "step", "cpu", 300, ("-m", "harness.perf.step.launches", "--check", "docs/perf/launches.json"),
          "kernel launches per decoder layer of a decode step (GPU paths emulated), against the committed count",
          output="launches.json"),
    Suite("launches-gpu", "step", "gpu", 30, ("-m", "harness.perf.step.launches", "--device", "cuda"),
          "the same launch count on a real GPU", output="launches-gpu.json"),
    Suite("tp-overhead", "step", "gpu", 90, ("-m", "harness.perf.step.tp_overhead"),
          "decode step of TP 1 plain vs TP 1 through the distributed path: the collectives' cost",
          output="tp-overhead.json"),
    Suite("spec-cost", "step", "gpu", 70, ("-m", "harness.perf.step.eagle_cost", "--llama8b"),
          "EAGLE-3 pass cost for a Llama-3.1-8B-shaped FP8 target and the speedup it implies",
          output="eagle3-cost.json"),
    Suite("eagle-cost", "step", "cpu", 600,
          ("-m", "harness.perf.step.eagle_cost", "--engine", "build/smollm2-135m-bf16-eagle3/engine", "--dtype",
           "float32"),
          "EAGLE-3 cost per target pass with k drafts on the SmolLM2 EAGLE-3 bundle", output="eagle3-cost-cpu.json",
          make="bench-eagle-cost"),
    # throughput
    Suite("bench-engine", "throughput", "cpu", 900, ("-m", "harness.perf.throughput.engine"),
          "executor throughput vs Hugging Face generate on this CPU, same prompts, same run",
          output="bench-engine.json", out_flag="--output", make="bench-engine"),
    Suite("bench-gpu", "throughput", "gpu", 115, ("-m", "harness.perf.throughput.gpu"),
          "Llama-3.1-8B-shaped FP8 engine: single stream vs the bandwidth floor, 1000/1000 throughput",
          output="gpu-bench.json", make="bench-gpu"),
    Suite("eagle", "throughput", "cpu", 1800,
          ("-m", "harness.perf.throughput.eagle", "--engine", "build/smollm2-135m-bf16-eagle3/engine",
           "--num-prompts", "16", "--max-tokens", "64", "--batches", "1,8", "--dtype", "float32"),
          "EAGLE-3 acceptance and speed vs plain decoding on MT-bench", output="eagle3.json", make="bench-eagle"),
    # serving
    Suite("serving", "serving", "cpu", 900, ("-m", "harness.perf.serving.sweep"),
          "the real Triton server over gRPC: concurrency sweep and Poisson arrivals, goodput, CPU per process",
          out_flag="--output", make="bench"),
    Suite("serving-ceiling", "serving", "cpu", 900, ("-m", "harness.perf.serving.ceiling"),
          "the serving path's cost with a near-zero-cost model: the executor alone vs through Triton",
          output="serving-ceiling.json", out_flag="--output"),
    Suite("openai-aiperf", "serving", "cpu", 900, ("harness/perf/serving/openai_aiperf.sh",),
          "NVIDIA AIPerf against the OpenAI front door (RESULT=F names the result file)", script=True,
          out_flag=None, make="bench-openai"),
    # build
    Suite("build-time", "build", "cpu", 600, ("-m", "harness.perf.build_cost", "time"),
          "a full build, every stage rebuilt, per-stage seconds", output="build-time.json", out_flag="--json"),
    Suite("build-memory", "build", "cpu", 1800, ("-m", "harness.perf.build_cost", "memory"),
          "peak RSS per build stage on random-weight Llamas of two depths", output="build-memory.json",
          out_flag="--json"),
    Suite("quant-gpu", "build", "gpu", 190, ("-m", "harness.perf.quant_gpu"),
          "streamed FP8 quantization of a random-weight Llama-3.1-8B-shaped checkpoint on the GPU",
          output="quant-gpu.json"),
    # grammar
    Suite("grammar-mask", "grammar", "cpu", 300,
          ("-m", "harness.perf.grammar", "--tokenizer", "build/smollm2-135m-fp8/engine/tokenizer/tokenizer.json"),
          "xgrammar vs llguidance: schema compile, next-token mask, mask apply", output="grammar-mask.json"),
    # reliability
    Suite("soak", "reliability", "cpu", 1800, ("-m", "harness.perf.soak"),
          "1,000 mixed requests at concurrency 64, 10% cancelled, 5% malformed, KV pool 1/8 of demand",
          output="soak.json", make="soak"),
    Suite("cancel-storm", "reliability", "cpu", 900,
          ("-m", "harness.cancel_storm", "build/smollm2-135m-fp8/model_repository"),
          "1,000 client-cancelled gRPC streams mixed with normal requests: nothing leaks", out_flag=None),
)

BY_NAME = {s.name: s for s in SUITES}
assert len(BY_NAME) == len(SUITES), "suite names are unique"
assert all(s.group in GROUPS and s.device in ("cpu", "gpu") for s in SUITES)


@dataclass(frozen=True)
class Step:
    """One suite inside a GPU host run: its limit (``limit_env`` overrides it), its arguments (``args``,
    then ``default_args`` unless ``args_env`` is set, which replaces them; ``after_part``: arguments
    added when that part runs in the same call), and the log it writes into the run's folder (its
    stem names the step in the output)."""
    suite: str
    limit_s: int
    limit_env: str
    args_env: str | None = None
    default_args: tuple[str, ...] = ()
    log: str = ""
    args: tuple[str, ...] = ()
    after_part: tuple[str, tuple[str, ...]] | None = None
    budget_flag: str | None = None      # passed the step's limit less 5 s, to end in time to write its result
    time_limit_env: tuple[str, ...] = ()  # the first set names --time-limit
    show_last_line: bool = False        # the log's last line is printed after the step (a refusal, a summary)


# The GPU host's run: parts in this order, each a list of steps with time budgets (seconds). Together
# the default parts fit one 530-second call (T_TOTAL); a step is cut to what is left of it.
GPU_HOST: tuple[tuple[str, tuple[Step, ...]], ...] = (
    ("check", (Step("gpu-check", 100, "T_CHECK", log="gpu-check.log"),)),
    ("kernels", (Step("bench-kernels", 120, "T_KERNELS", "KERNEL_ARGS", log="bench-kernels.log"),)),
    ("dtests", (Step("dtests", 60, "T_DTESTS", log="dtests.log"),)),
    ("sweep", (Step("sweep", 150, "T_SWEEP", "SWEEP_KERNELS", ("paged_decode_fp8",), log="sweep.log"),)),
    ("ncu", (Step("ncu", 60, "T_NCU", log="ncu.txt"),)),
    ("bench", (Step("host-overhead-gpu-host", 25, "T_HOST", log="host-overhead.log"),
               Step("bench-gpu", 115, "T_BENCH", "BENCH_ARGS", log="bench-gpu.log", args=("--skip-eager",),
                    budget_flag="--budget-s", time_limit_env=("TIME_LIMIT", "MAX_SECONDS")))),
    ("spec", (Step("spec-cost", 70, "T_SPEC", "SPEC_ARGS", ("--draft-lens", "0,4", "--reps", "3", "--breakdown"),
                   log="spec-cost.log"),)),
    # decode-perf skips the fused-kernel tests when part kernels ran them in the same call
    ("perf", (Step("decode-perf", 70, "T_PERF", "PERF_ARGS", log="decode-perf.log",
                   after_part=("kernels", ("--skip-tests",))),
              Step("launches-gpu", 30, "T_LAUNCHES", log="launches-gpu.log"))),
    ("tp", (Step("tp-overhead", 90, "T_TP", "TP_ARGS", log="tp.log", show_last_line=True),)),
    ("families", (Step("gpu-check-families", 90, "T_FAMILIES", log="gpu-check-families.log"),)),
)
DEFAULT_PARTS = ("check", "kernels", "bench", "spec", "perf")
TOTAL_S = 530          # one 600-second call of a GPU host, less start-up and transfers
MIN_STEP_S = 20        # a step with less left than this is skipped (said so), not started
assert all(step.suite in BY_NAME for _, steps in GPU_HOST for step in steps)
