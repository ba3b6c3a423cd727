"""Column-side kernels: dK/dV of the cache and of the extra (mask) keys.

One program per (batch, kv head, key block); it loops over the q blocks that
can see the block (`q_lo .. q_hi`, from the wrapper's tables) and accumulates
dK, dV in fp32. Everything is computed transposed — scores `(bk, bq)`, row
statistics lane-dense `(1, bq)` — so no transposed-lhs matmul is needed.
The G q heads of the kv head are rows, so their contributions are summed
into the one kv head for free (GQA).

The key blocks arrive through BlockSpecs on both backends: the cache is kv-head
major (`[B, K, Sp, D]`), so cache block j of (batch, kv head) is a contiguous
`[bk, D]` tile (on TPU, the BlockSpec pipeline prefetches the next program's
block while this one computes), and dK/dV of the cache are written back in
that same layout.

The q-side operands of one (batch, kv head) are whole blocks (`[nQ, bq, D]`)
indexed by the loop: fine for the training layout (rows = anchors * bs * G);
on TPU they live in VMEM, so very long row counts need a smaller problem per
call.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from flexdraft_jax.kernels import _common as C
from flexdraft_jax.kernels import _platform


def _col_body(cfg: C.Cfg, mode, j, k, v, kg, rows, q_lo, q_hi):
  q_ref, do_ref, lse_ref, delta_ref, vis_ref = rows
  bkk, d = k.shape

  def qblock(i, carry):
    if mode == "cache":
      mask = C.cache_mask_cols(j, cfg.bk, vis_ref[i])
    else:
      mask = C.group_mask(vis_ref[i], kg)
    return C.dkv_step(cfg, carry, k, v, q_ref[i], do_ref[i], lse_ref[i],
                      delta_ref[i], mask)

  zeros = jnp.zeros((bkk, d), jnp.float32)
  dk, dv = lax.fori_loop(q_lo, q_hi, qblock, (zeros, zeros))
  return dk * cfg.scale, dv


def _kernel_gpu(cfg: C.Cfg, mode, k_ref, v_ref, *refs):
  if mode == "extra":
    kg_ref, refs = refs[0], refs[1:]
  rows, (lo_ref, hi_ref, dk_ref, dv_ref) = refs[:5], refs[5:]
  b, j = pl.program_id(0), pl.program_id(2)
  if mode == "cache":
    q_lo, q_hi, kg = lo_ref[b, j], hi_ref[b, j], None
  else:
    q_lo, q_hi, kg = lo_ref[j], hi_ref[j], kg_ref[...]
  dk, dv = _col_body(cfg, mode, j, k_ref[...], v_ref[...], kg, rows,
                     q_lo, q_hi)
  dk_ref[...] = dk
  dv_ref[...] = dv


def _kernel_tpu(cfg: C.Cfg, mode, lo_ref, hi_ref, k_ref, v_ref, *refs):
  if mode == "extra":
    kg_ref, refs = refs[0], refs[1:]
  rows, (dk_ref, dv_ref) = refs[:5], refs[5:7]
  b, j = pl.program_id(0), pl.program_id(2)
  if mode == "cache":
    kg, t = None, b * cfg.n_k + j      # the tables come flattened (SMEM)
  else:
    kg, t = kg_ref[...], j
  dk, dv = _col_body(cfg, mode, j, k_ref[...], v_ref[...], kg, rows,
                     lo_ref[t], hi_ref[t])
  dk_ref[...] = dk
  dv_ref[...] = dv


def col_call(cfg: C.Cfg, mode, k, v, kg, rows, tables):
  """dK, dV for the cache ("cache") or the extra keys ("extra").

  Args (kernel layout):
    k, v: cache `[B, K, Sp, D]` or extra `[B, K, nE, be, D]`;
    kg: extra key groups as columns `[nE, be, 1]` (extra mode) or None;
    rows: (q5, do5 `[B, K, nQ, bq, D]`, lseT, deltaT `[B, K, nQ, 1, bq]`,
      visT: limits `[B, nQ, 1, bq]` (cache) or row groups `[nQ, 1, bq]`);
    tables: (q_lo, q_hi) `[B, nK]` (cache) or `[nE]` (extra).
  Returns: (dk, dv) fp32, in the layout of k, v: `[B, K, Sp, D]` (cache)
    or `[B, K, nE, be, D]` (extra).
  """
  q5, do5, lse_t, delta_t, vis_t = rows
  B, K, nQ, bq, D = q5.shape
  nb, blk = (cfg.n_k, cfg.bk) if mode == "cache" else (cfg.n_e, cfg.be)
  grid = (B, K, nb)
  tpu = cfg.backend == "tpu"
  whole = lambda shape: pl.BlockSpec(
      (None, None) + shape, lambda b, h, j, *_: (b, h) + (0,) * len(shape))
  if mode == "cache":
    vis_spec = pl.BlockSpec((None, nQ, 1, bq), lambda b, h, j, *_: (b, 0, 0, 0))
  else:
    vis_spec = pl.BlockSpec((nQ, 1, bq), lambda b, h, j, *_: (0, 0, 0))
  row_specs = [whole((nQ, bq, D)), whole((nQ, bq, D)), whole((nQ, 1, bq)),
               whole((nQ, 1, bq)), vis_spec]
  if mode == "cache":   # block j of the contiguous [Sp, D] slab of (b, h)
    kv_spec = pl.BlockSpec((None, None, blk, D),
                           lambda b, h, j, *_: (b, h, j, 0))
  else:
    kv_spec = pl.BlockSpec((None, None, None, blk, D),
                           lambda b, h, j, *_: (b, h, j, 0, 0))
  in_specs = [kv_spec, kv_spec]
  args = [k, v]
  if mode == "extra":
    in_specs.append(pl.BlockSpec((None, blk, 1), lambda b, h, j, *_: (j, 0, 0)))
    args.append(kg)
  in_specs += row_specs
  args += list(rows)
  out_spec = kv_spec     # dK, dV: the layout of k, v
  out_shape = (jax.ShapeDtypeStruct(k.shape, jnp.float32),) * 2
  q_lo, q_hi = tables

  if tpu:
    from jax.experimental.pallas import tpu as pltpu
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
        out_specs=(out_spec, out_spec))
    call = pl.pallas_call(
        functools.partial(_kernel_tpu, cfg, mode), grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=_platform.compiler_params(cfg, 3),
        interpret=_platform.interpret_arg(cfg),
        cost_estimate=_cost(q5, k, args, out_shape),
        name=f"flexdraft_attn_d{mode}")
    return call(q_lo.reshape(-1), q_hi.reshape(-1), *args)

  full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  in_specs += [full(q_lo.shape), full(q_hi.shape)]
  call = pl.pallas_call(
      functools.partial(_kernel_gpu, cfg, mode), grid=grid,
      in_specs=in_specs, out_specs=(out_spec, out_spec), out_shape=out_shape,
      compiler_params=_platform.compiler_params(cfg, 3),
      interpret=_platform.interpret_arg(cfg),
      cost_estimate=_cost(q5, k, args, out_shape),
      name=f"flexdraft_attn_d{mode}")
  return call(*args, q_lo, q_hi)


def _cost(q5, k, args, out_shape):
  """The call's CostEstimate, every q row against every key (an upper bound):
  4 matmuls a (row, key) pair (QK, dO V, P dO, dS Q)."""
  B, K, nQ, bq, D = q5.shape
  keys = math.prod(k.shape[2:-1])
  rows = nQ * bq
  return _platform.cost_estimate(2 * 4 * B * K * rows * keys * D, B * K * rows * keys,
                                 list(args) + list(out_shape))
