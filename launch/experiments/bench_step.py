"""Step costs: ms and GFLOP per decode step for each (mode, verify length k, batch),
next to AR, and the GFLOP/s achieved against this machine's matmul peak.

  PYTHONPATH=. python launch/experiments/bench_step.py --batch_sizes=1,4,16 --ks=2,3,5,9,16

These are the inputs of flex's cost model (predicted tokens/s = τ(k) / cost):
a step that verifies k positions pays for k tokens through every layer plus the
draft pass (bs mask rows through the L deep layers, the draft head and the
calibration). Each (mode, k) decodes the same batch of GSM8K test prompts
(greedy, stops off) once untimed, then once timed; ms/step is the engine's decode
time over its steps (host overhead between device loops included). GFLOP are
counted from the shapes (matmuls and attention; norms, RoPE and softmax left
out); the peak is the best of a few fp32 matmuls of the step's largest shape class.
"""

from __future__ import annotations

import json
import sys
import time

from absl import app, flags

flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "batch sizes")
flags.DEFINE_list("ks", ["2", "3", "5", "9", "16"], "verify lengths (≤ the block size)")
flags.DEFINE_list("modes", ["sequential", "parallel"], "speculative modes")
flags.DEFINE_integer("max_new_tokens", 48, "new tokens per row")
flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8", "drafter directory")
flags.DEFINE_string("data_dir", "", "benchmark files (default: ../shared/data or $FLEXDRAFT_DATA)")
flags.DEFINE_string("out", "", "write the results as JSON here")
FLAGS = flags.FLAGS


def token_flops(cfg, ctx: float, layers: int) -> float:
  """FLOPs of one row through `layers` decoder layers attending to `ctx` keys."""
  H, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  N, K = cfg.num_heads, cfg.num_kv_heads
  per_layer = 2 * (H * (N + 2 * K) * D + N * D * H + 3 * H * F) + 4 * N * D * ctx
  return layers * per_layer


def step_flops(cfg, dcfg, mode: str, k: int, batch: int, ctx: float) -> float:
  """FLOPs of one decode step over the batch (SPEC §2 row counts)."""
  V, H, bs, L = cfg.vocab_size, cfg.hidden_size, dcfg.block_size, dcfg.num_layers
  head = 2 * H * V
  if mode == "ar":
    return batch * (token_flops(cfg, ctx, cfg.num_layers) + head)
  verify = k * (token_flops(cfg, ctx + k / 2, cfg.num_layers) + head)
  groups = k if mode == "parallel" else 1
  masks = groups * bs * token_flops(cfg, ctx + k / 2 + bs / 2, L)
  kv = dcfg.draft_vocab or V
  drafts = (bs - 1) * (2 * H * kv + 2 * (2 * H * dcfg.calib_rank + dcfg.calib_rank * kv))
  return batch * (verify + masks + drafts)


def matmul_peak() -> float:
  """Best GFLOP/s of fp32 [512, 576] x [576, 4096] matmuls (jitted)."""
  import jax
  import jax.numpy as jnp
  a = jnp.ones((512, 576), jnp.float32)
  b = jnp.ones((576, 4096), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  f(a, b).block_until_ready()
  best = 0.0
  for _ in range(10):
    t = time.perf_counter()
    f(a, b).block_until_ready()
    best = max(best, 2 * 512 * 576 * 4096 / (time.perf_counter() - t) / 1e9)
  return best


def main(argv):
  del argv
  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import benchmarks, plan
  from flexdraft_jax.paths import data_root
  target = fd.load_target("smollm2-135m", layout="layers")
  drafter = fd.load_drafter(plan.resolve_path(FLAGS.drafter), target)
  cfg, dcfg = target.config, drafter.config
  kw = benchmarks.chat_kwargs(target)
  sizes = [int(b) for b in FLAGS.batch_sizes]
  ks = [int(k) for k in FLAGS.ks if int(k) <= dcfg.block_size]
  rows = benchmarks.load_benchmark("gsm8k", FLAGS.data_dir or data_root(), max(sizes))
  peak = matmul_peak()
  print(f"fp32 matmul peak: {peak:.1f} GFLOP/s; drafter L={dcfg.num_layers} "
        f"bs={dcfg.block_size} draft vocabulary {dcfg.draft_vocab or 'full'}", flush=True)
  print("| batch | mode | k | ms/step | × AR step | GFLOP/step | GFLOP/s | % of peak | τ |")
  print("|---|---|---|---|---|---|---|---|---|")
  results = []
  for b in sizes:
    ids = [benchmarks.render(target.tokenizer, benchmarks.messages_for_turn(p, []), kw)
           for p in rows[:b]]
    ctx = sum(len(x) for x in ids) / len(ids) + FLAGS.max_new_tokens / 2
    runs = [("ar", 0)] + [(m, k) for m in FLAGS.modes for k in ks]
    ar_ms = None
    for mode, k in runs:
      opts = ({} if mode == "ar" else
              dict(drafter=drafter, speculation=fd.SpecOptions(verify_len=k)))
      for _ in range(2):  # the first call compiles
        res = fd.generate(target, ids, max_new_tokens=FLAGS.max_new_tokens, stop=[],
                          mode=mode, **opts)
      ms = 1e3 * res.stats["decode_seconds"] / max(res.stats["steps"], 1)
      ar_ms = ar_ms or ms
      gf = step_flops(cfg, dcfg, mode, k, b, ctx) / 1e9
      row = {"batch": b, "mode": mode, "k": k, "ms_per_step": ms, "gflop_per_step": gf,
             "gflop_per_s": gf / ms * 1e3, "tau": res.stats["tau"]}
      results.append(row)
      print(f"| {b} | {mode} | {k or '-'} | {ms:.1f} | {ms / ar_ms:.2f} | {gf:.2f} | "
            f"{row['gflop_per_s']:.1f} | {100 * row['gflop_per_s'] / peak:.0f} % | "
            f"{res.stats['tau']:.2f} |", flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"matmul_peak_gflop_per_s": peak, "results": results}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
