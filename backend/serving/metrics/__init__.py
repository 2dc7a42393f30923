"""Serving figures: Kiln's metric families and NVIDIA's ``nv_trt_llm_*`` (``metrics.py``,
``nv_metrics.py``), per-request performance outputs (``perf_metrics.py``) and speculative decoding's
acceptance figures (``acceptance.py``). Imports nothing else from ``backend.serving``."""
