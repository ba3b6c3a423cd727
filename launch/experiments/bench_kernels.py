"""Times the Pallas attention kernel against the XLA reference, decode step.

Shapes: the parallel-mode decode step of SPEC §2 — a verify block of
`--block` clean rows plus G mask groups of `--block` rows each (G in
`--groups`; G = 0 is plain verification), against a KV cache of `--cache`
slots of which the first `--commit` are committed (row limits ~ commit).
The cache is kv-head major, `[B, K, S, D]` (attend_xla's layout), and goes
to the kernel as is.
One layer's attention call for each model's head layout:
  smollm2_135m: 9 q heads, 3 kv heads, head_dim 64;
  qwen3_8b:     32 q heads, 8 kv heads, head_dim 128.

Each configuration is jitted, warmed up, then timed `--iters` times with
block_until_ready; the median is reported with the achieved K/V bandwidth:
  kernel: unique K/V bytes it must read (the cache blocks up to the rows'
          limits, plus the mask K/V) / time — re-reads of a block by several
          q blocks (served from L2 on GPU) are not counted;
  xla:    the reference reads the whole cache (plus the mask K/V) / time.
It also prints the max |kernel - reference| of each configuration, so the
first run on a new device doubles as a correctness check of the compiled
(non-interpreted) kernels. `--grad_check` additionally compares forward +
backward of the training layout (grads into q and mask K/V) on the device.

Run (one command, from the repository root):
  GPU or TPU:  PYTHONPATH=. python launch/experiments/bench_kernels.py
               (add --grad_check for the backward check)
  CPU smoke:   PYTHONPATH=. python launch/experiments/bench_kernels.py --interpret \\
                 --models=smollm2_135m --batches=1 --groups=0,4
               (interpret mode: checks that it runs; the timings are
               meaningless.)
"""

from __future__ import annotations

import sys

from absl import app
from absl import flags
import jax

from flexdraft_jax.evaluation import kernel_bench
from flexdraft_jax.evaluation.kernel_bench import MODELS

FLAGS = flags.FLAGS
flags.DEFINE_list("models", list(MODELS), "Head layouts to time.")
flags.DEFINE_list("batches", ["1", "16"], "Batch sizes.")
flags.DEFINE_list("groups", ["0", "4", "16"], "Mask groups G per sequence.")
flags.DEFINE_integer("cache", 2048, "KV cache slots (S).")
flags.DEFINE_integer("commit", 300, "Committed length c: row limits ~ c.")
flags.DEFINE_integer("block", 16, "Block size bs (verify rows, masks/group).")
flags.DEFINE_integer("iters", None, "Timed iterations (default 50; 2 with "
                     "--interpret).")
flags.DEFINE_integer("warmup", None, "Warm-up calls (default 5; 1 with "
                     "--interpret).")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "K/V/q dtype.")
flags.DEFINE_enum("backend", "auto", ["auto", "gpu", "tpu"], "Kernel family.")
flags.DEFINE_bool("interpret", False, "Run the kernels in interpret mode "
                  "(needed on CPU; timings are then meaningless).")
flags.DEFINE_integer("block_q", None, "Kernel q-row block (default per "
                     "backend).")
flags.DEFINE_integer("block_k", None, "Kernel cache-key block.")
flags.DEFINE_integer("block_e", None, "Kernel extra-key block.")
flags.DEFINE_bool("grad_check", False, "Also check forward+backward of the "
                  "training layout against jax.grad of the reference.")


def main(argv):
  del argv
  platform = jax.default_backend()
  interpret = FLAGS.interpret
  if platform == "cpu" and not interpret:
    print("error: Pallas kernels need a GPU or TPU; on CPU pass --interpret "
          "(a functional smoke run, timings meaningless)", file=sys.stderr)
    sys.exit(1)
  kernel_kw = dict(backend=FLAGS.backend, interpret=interpret, block_q=FLAGS.block_q,
                   block_k=FLAGS.block_k, block_e=FLAGS.block_e)
  if interpret:
    print("NOTE: interpret mode on", platform, "- the timings and bandwidths "
          "below are meaningless; this run only checks that it works.")
  print(kernel_bench.HEADER)
  res = kernel_bench.run(FLAGS.models, [int(b) for b in FLAGS.batches],
                         [int(g) for g in FLAGS.groups], cache=FLAGS.cache,
                         commit=FLAGS.commit, block=FLAGS.block, iters=FLAGS.iters,
                         warmup=FLAGS.warmup, dtype=FLAGS.dtype,
                         log=lambda row: print(kernel_bench.format_row(row), flush=True),
                         **kernel_kw)
  print(f"platform={res['platform']} device={res['device']} kernels={res['kernels']} "
        f"interpret={res['interpret']} dtype={res['dtype']} cache={res['cache']} "
        f"commit={res['commit']} bs={res['block']} iters={res['iters']}")
  if FLAGS.grad_check:
    for name, err in kernel_bench.grad_check(**kernel_kw).items():
      print(f"grad_check {name}: max rel err {err:.2e}")


if __name__ == "__main__":
  app.run(main)
