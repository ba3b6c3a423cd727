"""Drafter training throughput: mask rows per second of the real train step.

  PYTHONPATH=. python launch/experiments/bench_train.py --config configs/smollm2_135m.py \
      --config.train.deep_kv_dir=runs/deep_kv --steps=12

Builds the trainer exactly as `train` does (target, records, the precomputed
clean K/V, the jitted step), runs one untimed step of each batch width the timed
steps will meet (the compiles), then times steps 0..`--steps`-1, batch assembly on
the host included, and prints mask rows/s (of the median step, and the mean step:
with widths that vary, the mean is a run's rate) with an analytic per-row FLOP
breakdown (forward + backward) of where a step's compute goes. Without
precomputed K/V a batch is cut to its own width (`train.width_multiple`).
Point PYTHONPATH at another checkout to time its trainer with the same data.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", 12, "timed steps", lower_bound=1)


def flops_per_row(cfg, dcfg, seq_len: int) -> dict:
  """Forward+backward FLOPs of one drafting mask row, by part. Frozen weights
  need the input gradient only (2× forward); trained ones also their own (3×)."""
  H, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  N, K, L = cfg.num_heads, cfg.num_kv_heads, dcfg.num_layers
  V = dcfg.get("draft_vocab", 0) or cfg.vocab_size
  r = dcfg.calib_rank
  mac = lambda n, passes: 2 * n * passes
  keys = seq_len / 2 + dcfg.block_size   # causal clean keys on average + the block
  return {
      "draft q/k/v/o (trained)": mac(L * H * (2 * N * D + 2 * K * D), 3),
      "attention": mac(L * 2 * N * D * keys, 2),
      "frozen FFN": mac(L * 3 * H * F, 2),
      "draft LM head (frozen)": mac(H * V, 2),
      "calibration MLP (trained)": mac(2 * H * r + r * V, 3),
  }


def main(argv):
  del argv
  import jax

  from flexdraft_jax.training import sharding, train
  config = FLAGS.config
  tc = config.train
  su = train.setup(config, None)
  state, target_params, packer, (train_step, _), mesh = (
      su.state, su.target_params, su.packers.train, su.steps, su.mesh)
  bs = config.drafter.block_size
  rows_per_step = tc.batch_size * tc.anchors_per_seq * bs
  rows = sharding.local_rows(tc.batch_size)

  def step_once(step):
    nonlocal state
    host = packer.train_batch(step, tc.batch_size, rows)
    state, m = train_step(state, target_params, sharding.put_batch(host, mesh, tc.batch_size))
    jax.block_until_ready(m)
    return host["tokens_BxT"].shape[1]

  # Compile every width the timed steps will meet first (one step of each).
  first_of = {}
  for step in range(FLAGS.steps):
    first_of.setdefault(packer.step_width(step, tc.batch_size), step)
  for step in sorted(first_of.values()):
    step_once(step)
  times, widths = [], []
  for step in range(FLAGS.steps):
    t0 = time.perf_counter()
    widths.append(step_once(step))
    times.append(time.perf_counter() - t0)
  dt = float(sorted(times)[len(times) // 2])
  # Rows that draft (slot 0 only carries attention for the others).
  parts = flops_per_row(su.target.config, config.drafter, tc.seq_len)
  drafting_rows = tc.batch_size * tc.anchors_per_seq * (bs - 1)
  total = sum(parts.values())
  out = {"seconds_per_step": round(dt, 3), "timed_steps": len(times),
         "mean_seconds_per_step": round(sum(times) / len(times), 3),
         "widths": sorted(set(widths)), "mean_width": round(sum(widths) / len(widths), 1),
         "mask_rows_per_step": rows_per_step,
         "mask_rows_per_s": round(rows_per_step / dt, 1),
         "mean_mask_rows_per_s": round(rows_per_step * len(times) / sum(times), 1),
         "draft_vocab": config.drafter.get("draft_vocab", 0),
         "gflop_per_step_est": round(total * drafting_rows / 1e9, 1),
         "gflop_per_s_est": round(total * drafting_rows / 1e9 / dt, 1),
         "share_of_flops": {k: round(v / total, 3) for k, v in parts.items()}}
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  import sys

  from flexdraft_jax.cli_util import define_flags
  define_flags(sys.argv)
  app.run(main)
