"""Evaluation: benchmark prompts, sweeps over modes and batch sizes, reports, the demo.

  benchmarks.py  load_benchmark(name, data_dir, limit) from local benchmark files
  sweep.py       `python -m flexdraft_jax eval`: resumable cells -> results.json
  report.py      results.json -> results.csv, results.md, PNG plots
  demo.py        `python -m flexdraft_jax.evaluation.demo` (what launch/demo.sh runs)
  modes_bench.py AR, flex and fixed (mode, k) timed in alternation (launch/bench_modes.py)
  kernel_bench.py  the Pallas attention kernels against XLA (launch/accelerator_bench.py)
"""

from flexdraft_jax.evaluation.benchmarks import BENCHMARKS, BenchmarkPrompt, load_benchmark

__all__ = ["BENCHMARKS", "BenchmarkPrompt", "load_benchmark"]
