"""The Pallas attention kernel against the XLA reference, decode-step shapes.

Shapes: the parallel-mode decode step of SPEC §2 — a verify block of `block`
clean rows plus G mask groups of `block` rows each (G = 0: plain verification),
against a KV cache of `cache` slots of which the first `commit` are committed
(row limits ~ commit). The cache is kv-head major, `[B, K, S, D]` (attend_xla's
layout), and goes to the kernel as is. One layer's attention call per head
layout in MODELS.

Each configuration is jitted, warmed up, then timed `iters` times with
block_until_ready; the median is reported with the achieved K/V bandwidth:
  kernel: unique K/V bytes it must read (the cache blocks up to the rows'
          limits, plus the mask K/V) / time — re-reads of a block by several
          q blocks (served from L2 on GPU) are not counted;
  xla:    the reference reads the whole cache (plus the mask K/V) / time.
and the max |kernel - reference|, so a first run on a new device doubles as a
correctness check of the compiled (non-interpreted) kernels. In interpret mode
(a CPU) the timings are meaningless: the run only checks that it works.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Optional, Sequence

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


def decode_inputs(key, B, N, K, D, S, c, bs, G, dtype):
  """Verify block at c..c+bs-1 (causal) + G groups (limit c+g, group g);
  returns (attention args, number of mask keys E)."""
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


def time_fn(fn, args, warmup: int, iters: int) -> float:
  """Median seconds of `fn(*args)` over `iters` calls after `warmup` ones."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def kernel_options(backend: str = "auto", interpret: Optional[bool] = None,
                   block_q=None, block_k=None, block_e=None) -> dict:
  """attend_pallas keyword arguments; `interpret` None: iff the platform is a CPU."""
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return dict(backend=backend, interpret=interpret or None, block_q=block_q,
              block_k=block_k, block_e=block_e)


def run(models: Sequence[str] = tuple(MODELS), batches: Sequence[int] = (1, 16),
        groups: Sequence[int] = (0, 4, 16), *, cache: int = 2048, commit: int = 300,
        block: int = 16, iters: Optional[int] = None, warmup: Optional[int] = None,
        dtype: str = "bfloat16", deadline: Optional[float] = None,
        log: Callable = lambda row: None, **kernel_kw) -> dict:
  """Times every (model, batch, G); returns {"platform", ..., "rows": [...]}.
  `kernel_kw`: see `kernel_options`. `deadline` (time.monotonic()): the
  configurations left when it passes are not run (listed in "not_run")."""
  kw = kernel_options(**kernel_kw)
  interpret = bool(kw["interpret"])
  iters = iters or (2 if interpret else 50)
  warmup = warmup if warmup is not None else (1 if interpret else 5)
  dt = jnp.dtype(dtype)
  backend = kattn._platform.resolve_backend(kw["backend"])
  bk = kattn._fit_block(kw["block_k"] or kattn.DEFAULT_BLOCKS[backend][1], cache, backend,
                        True)
  out = {"platform": jax.default_backend(), "device": jax.devices()[0].device_kind,
         "kernels": backend, "interpret": interpret, "dtype": dt.name, "cache": cache,
         "commit": commit, "block": block, "iters": iters, "rows": [], "not_run": []}
  kernel = jax.jit(functools.partial(kattn.attend_pallas, **kw))
  reference = jax.jit(attend_xla)
  for model in models:
    N, K, D = MODELS[model]
    for B in batches:
      for G in groups:
        if deadline is not None and time.monotonic() > deadline:
          out["not_run"].append(f"{model} B={B} G={G}")
          continue
        args, E = decode_inputs(jax.random.PRNGKey(0), B, N, K, D, cache, commit, block,
                                G, dt)
        t_k = time_fn(kernel, args, warmup, iters)
        t_x = time_fn(reference, args, warmup, iters)
        err = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32)
                                    - reference(*args).astype(jnp.float32))))
        kb = kv_bytes_read(B, K, D, cache, E, commit + block - 1, bk, dt.itemsize)
        xb = 2 * B * K * D * dt.itemsize * (cache + E)
        row = {"model": model, "batch": B, "groups": G, "rows": block + G * block,
               "kernel_us": t_k * 1e6, "xla_us": t_x * 1e6, "speedup": t_x / t_k,
               "kernel_gb_per_s": kb / t_k / 1e9, "xla_gb_per_s": xb / t_x / 1e9,
               "max_err": err}
        out["rows"].append(row)
        log(row)
  return out


HEADER = (f"{'model':<13} {'B':>3} {'G':>3} {'rows':>5} {'kernel_us':>10} {'xla_us':>10} "
          f"{'speedup':>8} {'kern_GB/s':>10} {'xla_GB/s':>10} {'max_err':>9}")


def format_row(r: dict) -> str:
  """One configuration as a line under HEADER."""
  return (f"{r['model']:<13} {r['batch']:>3} {r['groups']:>3} {r['rows']:>5} "
          f"{r['kernel_us']:>10.1f} {r['xla_us']:>10.1f} {r['speedup']:>8.2f} "
          f"{r['kernel_gb_per_s']:>10.1f} {r['xla_gb_per_s']:>10.1f} {r['max_err']:>9.2e}")


def markdown(result: dict) -> str:
  """The configurations as a markdown table, with the platform in a line above."""
  note = (" (interpret mode: the timings are meaningless, the run checks that it works)"
          if result["interpret"] else "")
  out = [f"Pallas attention ({result['kernels']} kernels) against XLA on "
         f"{result['device']}, {result['dtype']}, cache {result['cache']}, commit "
         f"{result['commit']}, block {result['block']}, median of {result['iters']}{note}.",
         "", "| model | B | G | query rows | kernel µs | XLA µs | XLA / kernel | kernel GB/s "
         "| XLA GB/s | max abs err |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    out.append(f"| {r['model']} | {r['batch']} | {r['groups']} | {r['rows']} | "
               f"{r['kernel_us']:.1f} | {r['xla_us']:.1f} | {r['speedup']:.2f} | "
               f"{r['kernel_gb_per_s']:.1f} | {r['xla_gb_per_s']:.1f} | {r['max_err']:.2e} |")
  if result["not_run"]:
    out += ["", f"Not run (time budget): {', '.join(result['not_run'])}."]
  return "\n".join(out) + "\n"


def grad_check(**kernel_kw) -> dict:
  """Training layout (deep-only mask rows, frozen clean K/V) forward + backward
  against jax.grad of the reference: {"out"|"dq"|"dxk"|"dxv": max rel err}."""
  B, N, K, D, S, bs, n_anchor = 2, 32, 8, 128, 512, 16, 4
  ks = jax.random.split(jax.random.PRNGKey(1), 6)
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

  def run_vjp(fn, q, k, v, lim, xk, xv, groups, ct):
    def f(q, xk, xv):  # the clean K/V (cache) are frozen: no grads
      return fn(q, k, v, lim, xk, xv, groups, groups)
    out, vjp = jax.vjp(f, q, xk, xv)
    return (out,) + vjp(ct)
  args = (q, k, v, lim, xk, xv, groups, ct)
  pallas = functools.partial(kattn.attend_pallas, **kernel_options(**kernel_kw))
  got = jax.jit(functools.partial(run_vjp, pallas))(*args)
  want = jax.jit(functools.partial(run_vjp, attend_xla))(*args)
  return {name: float(jnp.max(jnp.abs(g - w)) / jnp.maximum(1.0, jnp.max(jnp.abs(w))))
          for name, g, w in zip(("out", "dq", "dxk", "dxv"), got, want)}
