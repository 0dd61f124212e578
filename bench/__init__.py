"""Benchmarks: each module runs with `python -m bench.<name>` and writes bench/results/<name>.json and .png."""
