"""Ingot's benchmarks: `python -m benchmarks` lists them (benchmarks/__main__.py)."""
