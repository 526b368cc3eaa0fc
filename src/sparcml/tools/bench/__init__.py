"""Benchmarks: sparse allreduce micro-benchmarks on local gloo ranks."""

from .allreduce import BenchConfig, format_table, gradient_like, run_benchmark, write_outputs

__all__ = ["BenchConfig", "format_table", "gradient_like", "run_benchmark", "write_outputs"]
