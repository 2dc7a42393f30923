"""GPU checks that run on a lent GPU machine (see docs/perf/README.md): `prepare` here, `run` there."""
