"""The CPU roofline of decoding: this host's stream bandwidth and FMA peak, the
decode matmul kernel (flexdraft_jax/kernels/cpu_matmul.py) beside XLA's dot at
1-64 rows, and the decode step costs that follow.

  PYTHONPATH=. python launch/bench_cpu_roofline.py                 # all three
  PYTHONPATH=. python launch/bench_cpu_roofline.py --nosteps       # no model needed
  FLEXDRAFT_CPU_ISA=avx2 PYTHONPATH=. python launch/bench_cpu_roofline.py   # the AVX2 build

- Peaks, measured by the kernel library's own probes at its build's vector
  width: one pass over a buffer far larger than the caches (stream read GB/s)
  and multiply-adds on registers alone (GFLOP/s), on one thread and on every
  core at once.
- The matmul: `x[N, I] @ w[O, I].T` (default a [1536, 576] MLP weight of
  SmolLM2-135M) over `--weights` distinct weights, so each call streams its
  weight from DRAM as a decode step does; µs a call (the best of `--reps`),
  the weight's GB/s and the GFLOP/s, for the kernel and for XLA's dot as
  decoding runs it without the kernel (`transformer.xla_matmul_t`, the
  `FLEXDRAFT_CPU_MATMUL=0` path), both jitted with every core in XLA's pool. A memory-bound call costs the same
  for 1 row as for 8; past the ridge (N rows do N/2 flops a weight byte: N =
  2 x peak FLOP/s / stream bytes/s, printed) rows add their multiply-adds.
- Step costs: SmolLM2-135M decoding the first GSM8K test question (or a fixed
  prompt without the data) with the shipped drafter, ms a step (decode
  seconds / steps, the second of two runs) for AR, sequential chains of k,
  trees of N nodes and parallel groups of k, each as a multiple of AR's step.

The printed tables name the host's CPU, its ISA and the kernel build; compare
ratios measured in one run (a shared host's absolute figures drift).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import os
import platform
import sys
import time

from absl import app, flags

flags.DEFINE_list("rows", ["1", "2", "4", "8", "16", "32", "64"], "row counts N")
flags.DEFINE_list("shape", ["1536", "576"], "the weight's [O, I]")
flags.DEFINE_integer("weights", 48, "distinct weights a timed pass streams (past L3)")
flags.DEFINE_integer("reps", 7, "timed passes (the best is kept)")
flags.DEFINE_bool("steps", True, "also time decode steps of SmolLM2-135M")
flags.DEFINE_list("step_modes", ["ar", "sequential:2", "sequential:4", "sequential:8",
                                 "tree:16", "parallel:4"],
                  "decode steps to time: ar, sequential:k, tree:N, parallel:k")
flags.DEFINE_list("batch_sizes", ["1"], "batch sizes of the step costs")
flags.DEFINE_integer("max_new_tokens", 48, "new tokens a row (step costs)")
flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8", "drafter directory")
flags.DEFINE_string("data_dir", "", "benchmark files (default: ../shared/data or $FLEXDRAFT_DATA)")
flags.DEFINE_string("out", "", "also write the results as JSON to this new file")
FLAGS = flags.FLAGS

FALLBACK_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold "
                   "half as many clips in May. How many clips did Natalia sell altogether "
                   "in April and May?")


def host() -> dict:
  from flexdraft_jax.kernels import cpu_matmul
  name = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
  except OSError:
    pass
  flags_ = set(cpu_matmul._cpu_flags().split())
  isa = ("AVX-512" if "avx512f" in flags_ else "AVX2 + FMA" if {"avx2", "fma"} <= flags_
         else platform.machine())
  if "avx512_bf16" in flags_:
    isa += " (+ BF16)"
  return {"cpu": name, "isa": isa, "cores": os.cpu_count(),
          "kernel": cpu_matmul.build_info() or "unavailable (XLA's dot)"}


def _lib():
  from flexdraft_jax.kernels import cpu_matmul
  if not cpu_matmul.available():
    raise SystemExit("error: the CPU matmul kernel does not run here (see the warning above)")
  lib = cpu_matmul._LOADED[0]
  lib.FlexdraftFmaGflops.restype = ctypes.c_double
  lib.FlexdraftFmaGflops.argtypes = [ctypes.c_int64]
  lib.FlexdraftReadGBps.restype = ctypes.c_double
  lib.FlexdraftReadGBps.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
  return lib


def peaks() -> dict:
  """Stream read GB/s and FMA GFLOP/s, one thread and every core at once
  (ctypes calls release the GIL)."""
  import numpy as np
  lib, cores = _lib(), os.cpu_count() or 1
  per = 64 << 20  # floats a thread reads: 256 MB, far past any L3
  bufs = [np.ones(per, np.float32) for _ in range(cores)]
  def read(i):
    return lib.FlexdraftReadGBps(bufs[i].ctypes.data, per, 3)
  def fma(_):
    return lib.FlexdraftFmaGflops(20_000_000)
  out = {"read_gb_s_1": read(0), "fma_gflop_s_1": fma(0)}
  with concurrent.futures.ThreadPoolExecutor(cores) as ex:
    out["read_gb_s_all"] = sum(ex.map(read, range(cores)))
    out["fma_gflop_s_all"] = sum(ex.map(fma, range(cores)))
  return out


def matmuls(rows, O: int, I: int, n_weights: int, reps: int) -> list:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flexdraft_jax.kernels import cpu_matmul
  from flexdraft_jax.model import transformer
  rng = np.random.default_rng(0)
  ws = [jnp.asarray(rng.standard_normal((O, I), np.float32)) for _ in range(n_weights)]

  def chain(mm):
    def f(ws, x):
      acc = jnp.zeros((), jnp.float32)
      for w in ws:  # each call depends on the last: they run one at a time
        y = mm(w, x)
        acc = acc + y[0, 0]
        x = x + 1e-30 * acc
      return acc
    return jax.jit(f)

  fns = {"kernel": chain(cpu_matmul.matmul_t),
         "xla_dot": chain(transformer.xla_matmul_t)}
  out = []
  for n in rows:
    x = jnp.asarray(rng.standard_normal((n, I), np.float32))
    row = {"rows": n}
    for name, f in fns.items():
      f(ws, x).block_until_ready()
      best = float("inf")
      for _ in range(reps):
        t = time.perf_counter()
        f(ws, x).block_until_ready()
        best = min(best, (time.perf_counter() - t) / n_weights)
      row[f"{name}_us"] = 1e6 * best
      row[f"{name}_gb_s"] = 4 * O * I / best / 1e9
      row[f"{name}_gflop_s"] = 2 * n * O * I / best / 1e9
    out.append(row)
    print(f"  {n} rows: kernel {row['kernel_us']:.0f} µs, XLA's dot {row['xla_dot_us']:.0f} µs",
          file=sys.stderr, flush=True)
  return out


def step_costs(specs, sizes, max_new: int) -> list:
  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import benchmarks, plan
  from flexdraft_jax.paths import data_root
  target = fd.load_target("smollm2-135m", layout="layers")
  drafter = fd.load_drafter(plan.resolve_path(FLAGS.drafter), target)
  kw = benchmarks.chat_kwargs(target)
  try:
    rows = benchmarks.load_benchmark("gsm8k", FLAGS.data_dir or data_root(), max(sizes))
    prompts = [benchmarks.messages_for_turn(p, []) for p in rows]
  except (OSError, ValueError):
    prompts = [[{"role": "user", "content": FALLBACK_PROMPT}]] * max(sizes)
  out = []
  for b in sizes:
    ids = [benchmarks.render(target.tokenizer, m, kw) for m in prompts[:b]]
    ar_ms = None
    for spec in specs:
      mode, _, k = spec.partition(":")
      if mode == "ar":
        opts = {}
      elif mode == "tree":
        opts = dict(mode="sequential", drafter=drafter,
                    speculation=fd.SpecOptions(tree_budget=int(k)))
      else:
        opts = dict(mode=mode, drafter=drafter, speculation=fd.SpecOptions(verify_len=int(k)))
      for _ in range(2):  # the first run compiles
        res = fd.generate(target, ids, max_new_tokens=max_new, stop=[],
                          **({"mode": "ar"} | opts))
      ms = 1e3 * res.stats["decode_seconds"] / max(res.stats["steps"], 1)
      ar_ms = ar_ms or ms
      out.append({"batch": b, "step": spec, "ms": ms, "x_ar": ms / ar_ms,
                  "tau": res.stats["tau"]})
      print(f"  batch {b} {spec}: {ms:.1f} ms a step", file=sys.stderr, flush=True)
  return out


def tables(res: dict) -> str:
  h, p = res["host"], res["peaks"]
  lines = [f"Host: {h['cpu']}, {h['isa']}, {h['cores']} cores; kernel build: {h['kernel']}.", "",
           "| | one thread | all cores |", "|---|---|---|",
           f"| stream read (GB/s) | {p['read_gb_s_1']:.1f} | {p['read_gb_s_all']:.1f} |",
           f"| FMA peak (GFLOP/s) | {p['fma_gflop_s_1']:.0f} | {p['fma_gflop_s_all']:.0f} |",
           "", f"Ridge (all cores): {p['fma_gflop_s_all'] / p['read_gb_s_all'] * 2:.1f} rows "
           "(an fp32 weight byte feeds N/2 flops).", ""]
  if res.get("matmul"):
    O, I = res["shape"]
    one = res["matmul"][0]["kernel_us"]
    lines += [f"`x[N, {I}] @ w[{O}, {I}].T`, the weight from DRAM:", "",
              "| rows | kernel µs | × 1 row | GB/s | GFLOP/s | XLA's dot µs | GFLOP/s | kernel / dot |",
              "|---|---|---|---|---|---|---|---|"]
    for r in res["matmul"]:
      lines.append(f"| {r['rows']} | {r['kernel_us']:.0f} | {r['kernel_us'] / one:.2f} | "
                   f"{r['kernel_gb_s']:.1f} | {r['kernel_gflop_s']:.0f} | {r['xla_dot_us']:.0f} | "
                   f"{r['xla_dot_gflop_s']:.0f} | {r['kernel_us'] / r['xla_dot_us']:.2f} |")
    lines.append("")
  if res.get("steps"):
    lines += ["| batch | step | ms | × AR step | τ |", "|---|---|---|---|---|"]
    for s in res["steps"]:
      lines.append(f"| {s['batch']} | {s['step']} | {s['ms']:.1f} | {s['x_ar']:.2f} | "
                   f"{s['tau']:.2f} |")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if FLAGS.out and os.path.exists(FLAGS.out):
    raise SystemExit(f"error: --out {FLAGS.out} exists; name a new file")
  O, I = (int(v) for v in FLAGS.shape)
  res = {"host": host(), "peaks": peaks(), "shape": [O, I]}
  res["matmul"] = matmuls([int(n) for n in FLAGS.rows], O, I, FLAGS.weights, FLAGS.reps)
  if FLAGS.steps:
    res["steps"] = step_costs(FLAGS.step_modes, [int(b) for b in FLAGS.batch_sizes],
                              FLAGS.max_new_tokens)
  print(tables(res))
  if FLAGS.out:
    with open(FLAGS.out, "x") as f:
      json.dump(res, f, indent=1)
    print(f"wrote {FLAGS.out}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
