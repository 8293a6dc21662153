"""Benchmarks: `nanoserve bench ipc` (the process boundary) and friends."""
