"""GPU checks that run on an NVIDIA GPU host (see docs/perf/README.md): `prepare` here, `run` there."""
