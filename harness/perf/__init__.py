"""Benchmarks and performance measurement: the one home for them (product code never imports it)."""
