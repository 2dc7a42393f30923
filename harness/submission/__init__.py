"""MLPerf Inference submission packager (`python -m harness.submission`, `make submission`)."""
