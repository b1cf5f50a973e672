"""Benchmarks, process orchestration for tests and the demo, reports and plots."""
