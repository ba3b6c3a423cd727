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

import functools
import statistics
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax.kernels import attention as kattn
from flexdraft_jax.model.attention import attend_xla
from flexdraft_jax.util import round_up

MODELS = {  # name: (q heads, kv heads, head_dim)
    "smollm2_135m": (9, 3, 64),
    "qwen3_8b": (32, 8, 128),
}

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


def decode_inputs(key, B, N, K, D, S, c, bs, G, dtype):
  """Verify block at c..c+bs-1 (causal) + G groups (limit c+g, group g)."""
  T, E = bs + G * bs, G * bs
  ks = jax.random.split(key, 5)
  q = jax.random.normal(ks[0], (B, T, N, D), dtype)
  k = jax.random.normal(ks[1], (B, K, S, D), dtype)   # kv-head major
  v = jax.random.normal(ks[2], (B, K, S, D), dtype)
  lim_T = np.concatenate([c + np.arange(bs), c + np.repeat(np.arange(G), bs)])
  lim = jnp.broadcast_to(jnp.asarray(lim_T, jnp.int32), (B, T))
  if not G:
    return (q, k, v, lim), 0
  xk = jax.random.normal(ks[3], (B, E, K, D), dtype)
  xv = jax.random.normal(ks[4], (B, E, K, D), dtype)
  groups = jnp.asarray(np.repeat(np.arange(G), bs), jnp.int32)
  q_group = jnp.concatenate([jnp.full((bs,), -1, jnp.int32), groups])
  return (q, k, v, lim, xk, xv, q_group, groups), E


def kv_bytes_read(B, K, D, S, E, max_limit, bk, itemsize):
  """K/V bytes the kernel reads: visible cache blocks + mask K/V."""
  blocks = min(S, round_up(max_limit + 1, bk))
  return 2 * B * K * D * itemsize * (blocks + E)


def time_fn(fn, args, warmup, iters):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def grad_check(kernel_kw):
  """Training layout (deep-only mask rows, frozen clean K/V) fwd + bwd."""
  B, N, K, D, S, bs, n_anchor = 2, 32, 8, 128, 512, 16, 4
  key = jax.random.PRNGKey(1)
  ks = jax.random.split(key, 6)
  T = n_anchor * bs
  q = jax.random.normal(ks[0], (B, T, N, D), jnp.float32)
  k = jax.random.normal(ks[1], (B, K, S, D), jnp.float32)
  v = jax.random.normal(ks[2], (B, K, S, D), jnp.float32)
  xk = jax.random.normal(ks[3], (B, T, K, D), jnp.float32)
  xv = jax.random.normal(ks[4], (B, T, K, D), jnp.float32)
  ct = jax.random.normal(ks[5], (B, T, N, D), jnp.float32)
  anchors = jnp.asarray([[40, 170, 300, 505], [3, 99, 250, 511]], jnp.int32)
  lim = jnp.repeat(anchors, bs, axis=1)
  groups = jnp.repeat(jnp.arange(n_anchor, dtype=jnp.int32), bs)

  def run(fn, q, k, v, lim, xk, xv, groups, ct):
    def f(q, xk, xv):  # the clean K/V (cache) are frozen: no grads
      return fn(q, k, v, lim, xk, xv, groups, groups)
    out, vjp = jax.vjp(f, q, xk, xv)
    return (out,) + vjp(ct)
  args = (q, k, v, lim, xk, xv, groups, ct)
  pallas = functools.partial(kattn.attend_pallas, **kernel_kw)
  got = jax.jit(functools.partial(run, pallas))(*args)
  want = jax.jit(functools.partial(run, attend_xla))(*args)
  for name, g, w in zip(("out", "dq", "dxk", "dxv"), got, want):
    err = float(jnp.max(jnp.abs(g - w)) / jnp.maximum(1.0, jnp.max(jnp.abs(w))))
    print(f"grad_check {name}: max rel err {err:.2e}")


def main(argv):
  del argv
  platform = jax.default_backend()
  interpret = FLAGS.interpret
  if platform == "cpu" and not interpret:
    print("error: Pallas kernels need a GPU or TPU; on CPU pass --interpret "
          "(a functional smoke run, timings meaningless)", file=sys.stderr)
    sys.exit(1)
  iters = FLAGS.iters or (2 if interpret else 50)
  warmup = FLAGS.warmup if FLAGS.warmup is not None else (1 if interpret
                                                          else 5)
  dtype = jnp.dtype(FLAGS.dtype)
  kernel_kw = dict(backend=FLAGS.backend, interpret=interpret or None,
                   block_q=FLAGS.block_q, block_k=FLAGS.block_k,
                   block_e=FLAGS.block_e)
  backend = kattn._platform.resolve_backend(FLAGS.backend)
  bk_default = kattn.DEFAULT_BLOCKS[backend][1]
  bk = kattn._fit_block(FLAGS.block_k or bk_default, FLAGS.cache, backend,
                        True)
  print(f"platform={platform} device={jax.devices()[0].device_kind} "
        f"kernels={backend} interpret={interpret} dtype={dtype.name} "
        f"cache={FLAGS.cache} commit={FLAGS.commit} bs={FLAGS.block} "
        f"iters={iters}")
  if interpret:
    print("NOTE: interpret mode on", platform, "- the timings and bandwidths "
          "below are meaningless; this run only checks that it works.")
  kernel = jax.jit(functools.partial(kattn.attend_pallas, **kernel_kw))
  reference = jax.jit(attend_xla)
  header = (f"{'model':<13} {'B':>3} {'G':>3} {'rows':>5} "
            f"{'kernel_us':>10} {'xla_us':>10} {'speedup':>8} "
            f"{'kern_GB/s':>10} {'xla_GB/s':>10} {'max_err':>9}")
  print(header)
  S, c, bs = FLAGS.cache, FLAGS.commit, FLAGS.block
  for model in FLAGS.models:
    N, K, D = MODELS[model]
    for B in map(int, FLAGS.batches):
      for G in map(int, FLAGS.groups):
        args, E = decode_inputs(jax.random.PRNGKey(0), B, N, K, D, S, c, bs,
                                G, dtype)
        t_k = time_fn(kernel, args, warmup, iters)
        t_x = time_fn(reference, args, warmup, iters)
        err = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32)
                                    - reference(*args).astype(jnp.float32))))
        max_limit = c + bs - 1
        kb = kv_bytes_read(B, K, D, S, E, max_limit, bk, dtype.itemsize)
        xb = 2 * B * K * D * dtype.itemsize * (S + E)
        print(f"{model:<13} {B:>3} {G:>3} {bs + G * bs:>5} "
              f"{t_k * 1e6:>10.1f} {t_x * 1e6:>10.1f} {t_x / t_k:>8.2f} "
              f"{kb / t_k / 1e9:>10.1f} {xb / t_x / 1e9:>10.1f} "
              f"{err:>9.2e}", flush=True)
  if FLAGS.grad_check:
    grad_check(kernel_kw)


if __name__ == "__main__":
  app.run(main)
