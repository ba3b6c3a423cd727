"""Row-side kernels: the forward pass and dq.

One program per (batch, kv head, q block): the G q heads of the kv head are
folded into the rows, so every K/V block read serves all G heads (no
repeated K/V).
The program walks the cache key blocks `0 .. n_blocks[b, qblock]` (blocks
entirely past every row's limit are never read) and then the extra key
blocks `e_lo[qblock] .. e_hi[qblock]` (the only ones any row's group meets).

Backends differ only in how a cache block reaches the kernel. The cache is
kv-head major (`[B, K, Sp, D]`), so the (b, kv-head) cache is one contiguous
`[Sp, D]` slab and block j is its contiguous rows `[j*bk, (j+1)*bk)`:
  gpu (Triton): the kernel gets the slab as a pointer and loads block j
    itself (data-dependent trip count);
  tpu (Mosaic): the cache stays in HBM (`pl.ANY`) and block j is streamed
    into a double-buffered VMEM scratch with one contiguous async DMA per
    K/V, block j+1 in flight while block j is used; the trip counts come in
    SMEM via scalar prefetch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flexdraft_jax.kernels import _common as C
from flexdraft_jax.kernels import _platform


def _row_body(cfg: C.Cfg, mode, q, lim, qg, stats, n_cache, get_cache,
              e_lo, e_hi, get_extra, tree=None):
  """Shared loop; returns (out, lse) for "fwd" or unscaled-dq for "dq".

  `tree` (with `cfg.tree_nodes`): (start `(bq, 1)`, ancestor-mask words,
  each `(bq, 1)`) narrowing the tree's cache slots to each row's ancestors.
  """
  bq, d = q.shape
  if mode == "fwd":
    carry = C.fwd_init(bq, d)
    step = lambda c, k, v, m: C.fwd_step(cfg, c, q, k, v, m)
  else:
    do, lse, delta = stats
    carry = jnp.zeros((bq, d), jnp.float32)
    step = lambda c, k, v, m: C.dq_step(cfg, c, q, k, v, m, do, lse, delta)

  def cache_block(j, c):
    k, v = get_cache(j)
    mask = C.cache_mask_rows(j, cfg.bk, lim)
    if tree is not None:
      mask = mask & C.tree_mask_rows(j, cfg.bk, cfg.tree_nodes, *tree)
    return step(c, k, v, mask)

  carry = lax.fori_loop(0, n_cache, cache_block, carry)
  if cfg.has_extra:
    def extra_block(e, c):
      xk, xv, kg = get_extra(e)
      return step(c, xk, xv, C.group_mask(qg, kg))
    carry = lax.fori_loop(e_lo, e_hi, extra_block, carry)
  if mode == "fwd":
    return C.fwd_finish(carry)
  return (carry * cfg.scale,)


def _split(cfg, mode, refs, n_scalar):
  """Names the kernel's refs (the order built in `row_call`)."""
  refs = list(refs)
  scal = refs[:n_scalar]; refs = refs[n_scalar:]
  q, lim, qg, k, v = refs[:5]; refs = refs[5:]
  xk = xv = kg = tree = None
  if cfg.has_extra:
    xk, xv, kg = refs[:3]; refs = refs[3:]
  if cfg.tree_nodes:
    tree = tuple(refs[:2]); refs = refs[2:]
  stats = ()
  if mode == "dq":
    stats = tuple(refs[:3]); refs = refs[3:]
  return scal, q, lim, qg, k, v, xk, xv, kg, tree, stats, refs


def _tree_values(cfg: C.Cfg, tree_refs):
  """(start, words) loaded from the tree refs, or None without a tree."""
  if tree_refs is None:
    return None
  start_ref, words_ref = tree_refs
  return start_ref[...], tuple(words_ref[w] for w in range(cfg.tree_words))


def _kernel_gpu(cfg: C.Cfg, mode, *refs):
  # No scalar prefetch on Triton: the tables come last among the inputs.
  (_, q_ref, lim_ref, qg_ref, k_ref, v_ref, xk_ref, xv_ref, kg_ref,
   tree_refs, stat_refs, rest) = _split(cfg, mode, refs, 0)
  (nblk_ref, elo_ref, ehi_ref), outs = rest[:3], rest[3:]
  b, i = pl.program_id(0), pl.program_id(2)
  n_cache = nblk_ref[b, i]

  def get_cache(j):
    start = pl.multiple_of(j * cfg.bk, cfg.bk)
    return k_ref[pl.ds(start, cfg.bk), :], v_ref[pl.ds(start, cfg.bk), :]

  def get_extra(e):
    return xk_ref[e], xv_ref[e], kg_ref[e]

  res = _row_body(cfg, mode, q_ref[...], lim_ref[...], qg_ref[...],
                  tuple(r[...] for r in stat_refs), n_cache, get_cache,
                  elo_ref[i] if cfg.has_extra else 0,
                  ehi_ref[i] if cfg.has_extra else 0, get_extra,
                  _tree_values(cfg, tree_refs))
  for ref, val in zip(outs, res):
    ref[...] = val.astype(ref.dtype)


def _kernel_tpu(cfg: C.Cfg, mode, *refs):
  from jax.experimental.pallas import tpu as pltpu
  (tabs, q_ref, lim_ref, qg_ref, k_hbm, v_hbm, xk_ref, xv_ref, kg_ref,
   tree_refs, stat_refs, rest) = _split(cfg, mode, refs, 3)
  nblk_ref, elo_ref, ehi_ref = tabs
  n_out = 2 if mode == "fwd" else 1
  outs, (kbuf, vbuf, sem) = rest[:n_out], rest[n_out:]
  b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n_cache = nblk_ref[b * cfg.n_q + i]

  def dmas(j, slot):
    rows = pl.ds(pl.multiple_of(j * cfg.bk, cfg.bk), cfg.bk)
    return (pltpu.make_async_copy(k_hbm.at[b, h, rows], kbuf.at[slot],
                                  sem.at[0, slot]),
            pltpu.make_async_copy(v_hbm.at[b, h, rows], vbuf.at[slot],
                                  sem.at[1, slot]))

  @pl.when(n_cache > 0)
  def _():
    for c in dmas(0, 0):
      c.start()

  def get_cache(j):
    slot = lax.rem(j, 2)

    @pl.when(j + 1 < n_cache)
    def _():
      for c in dmas(j + 1, 1 - slot):
        c.start()

    for c in dmas(j, slot):
      c.wait()
    return kbuf[slot], vbuf[slot]

  def get_extra(e):
    return xk_ref[e], xv_ref[e], kg_ref[e]

  res = _row_body(cfg, mode, q_ref[...], lim_ref[...], qg_ref[...],
                  tuple(r[...] for r in stat_refs), n_cache, get_cache,
                  elo_ref[i], ehi_ref[i], get_extra,
                  _tree_values(cfg, tree_refs))
  for ref, val in zip(outs, res):
    ref[...] = val.astype(ref.dtype)


def row_call(cfg: C.Cfg, q, lim, qg, k, v, xk, xv, kg, tables,
             stats=(), out_dtype=None, tree=None):
  """Runs the row kernel.

  Args (kernel layout, padded): q `[B, K, Rp, D]`; lim `[B, Rp, 1]`;
    qg `[Rp, 1]`; k, v `[B, K, Sp, D]`; xk, xv `[B, K, nE, be, D]` and
    kg `[nE, 1, be]` (or None); tables = (nblk `[B, nQ]`, elo `[nQ]`,
    ehi `[nQ]`); stats = (do `[B,K,Rp,D]`, lse, delta `[B,K,Rp,1]`) for dq;
    tree (with `cfg.tree_nodes`) = (start `[B, Rp, 1]`, ancestor-mask words
    `[B, W, Rp, 1]` int32, W = `cfg.tree_words`).
  Returns: fwd -> (out `[B, K, Rp, D]` out_dtype, lse `[B, K, Rp, 1]` f32);
    dq -> (dq `[B, K, Rp, D]` f32,).
  """
  mode = "dq" if stats else "fwd"
  B, K, Rp, D = q.shape
  Sp = k.shape[2]
  bq, be, nE = cfg.bq, cfg.be, cfg.n_e
  grid = (B, K, cfg.n_q)
  nblk, elo, ehi = tables
  tpu = cfg.backend == "tpu"
  # Index maps take (*grid, *scalar_refs) on TPU; `*_` swallows the latter.
  row_spec = pl.BlockSpec((None, None, bq, D), lambda b, h, i, *_: (b, h, i, 0))
  col_spec = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, *_: (b, h, i, 0))
  in_specs = [row_spec,
              pl.BlockSpec((None, bq, 1), lambda b, h, i, *_: (b, i, 0)),
              pl.BlockSpec((bq, 1), lambda b, h, i, *_: (i, 0))]
  if tpu:
    in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * 2
  else:
    in_specs += [pl.BlockSpec((None, None, Sp, D),
                              lambda b, h, i, *_: (b, h, 0, 0))] * 2
  args = [q, lim, qg, k, v]
  if cfg.has_extra:
    x_spec = pl.BlockSpec((None, None, nE, be, D),
                          lambda b, h, i, *_: (b, h, 0, 0, 0))
    in_specs += [x_spec, x_spec,
                 pl.BlockSpec((nE, 1, be), lambda b, h, i, *_: (0, 0, 0))]
    args += [xk, xv, kg]
  if cfg.tree_nodes:
    in_specs += [pl.BlockSpec((None, bq, 1), lambda b, h, i, *_: (b, i, 0)),
                 pl.BlockSpec((None, cfg.tree_words, bq, 1),
                              lambda b, h, i, *_: (b, 0, i, 0))]
    args += list(tree)
  if stats:
    in_specs += [row_spec, col_spec, col_spec]
    args += list(stats)
  if mode == "fwd":
    out_shape = (jax.ShapeDtypeStruct((B, K, Rp, D), out_dtype),
                 jax.ShapeDtypeStruct((B, K, Rp, 1), jnp.float32))
    out_specs = (row_spec, col_spec)
  else:
    out_shape = (jax.ShapeDtypeStruct((B, K, Rp, D), jnp.float32),)
    out_specs = (row_spec,)

  if tpu:
    from jax.experimental.pallas import tpu as pltpu
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((2, cfg.bk, D), k.dtype),
                        pltpu.VMEM((2, cfg.bk, D), v.dtype),
                        pltpu.SemaphoreType.DMA((2, 2))])
    call = pl.pallas_call(
        functools.partial(_kernel_tpu, cfg, mode), grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=_platform.compiler_params(cfg, 3),
        interpret=_platform.interpret_arg(cfg),
        cost_estimate=_cost(cfg, mode, q, k, args, out_shape),
        name=f"flexdraft_attn_{mode}")
    return call(nblk.reshape(-1), elo, ehi, *args)

  full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  in_specs += [full(nblk.shape), full(elo.shape), full(ehi.shape)]
  call = pl.pallas_call(
      functools.partial(_kernel_gpu, cfg, mode), grid=grid,
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=_platform.compiler_params(cfg, 3),
      interpret=_platform.interpret_arg(cfg),
      cost_estimate=_cost(cfg, mode, q, k, args, out_shape),
      name=f"flexdraft_attn_{mode}")
  return call(*args, nblk, elo, ehi)


def _cost(cfg: C.Cfg, mode, q, k, args, out_shape):
  """The call's CostEstimate, for a row that sees the whole cache and every
  extra key (an upper bound: the kernels skip the blocks past each row's
  limit): 2 matmuls a key forward (QK, PV), 3 for dq (QK, dO V, dS K)."""
  B, K, Rp, D = q.shape
  keys = k.shape[2] + cfg.n_e * cfg.be
  per_key = 2 if mode == "fwd" else 3
  return _platform.cost_estimate(2 * per_key * B * K * Rp * keys * D, B * K * Rp * keys,
                                 list(args) + list(out_shape))
