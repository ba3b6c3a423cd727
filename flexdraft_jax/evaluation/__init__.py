"""Evaluation: benchmark prompts, sweeps over modes and batch sizes, reports, the demo.

  benchmarks.py  load_benchmark(name, data_dir, limit) from local benchmark files
  sweep.py       `python -m flexdraft_jax eval`: resumable cells -> results.json
  report.py      results.json -> results.csv, results.md, PNG plots
  demo.py        `python -m flexdraft_jax.evaluation.demo` (what launch/demo.sh runs)
"""

from flexdraft_jax.evaluation.benchmarks import BENCHMARKS, BenchmarkPrompt, load_benchmark

__all__ = ["BENCHMARKS", "BenchmarkPrompt", "load_benchmark"]
