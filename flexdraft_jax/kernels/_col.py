"""Column-side kernels: dK/dV of the cache and of the extra (mask) keys.

One program per (batch, kv head, key block); it loops over the q blocks that
can see the block (`q_lo .. q_hi`, from the wrapper's tables) and accumulates
dK, dV in fp32. Everything is computed transposed — scores `(bk, bq)`, row
statistics lane-dense `(1, bq)` — so no transposed-lhs matmul is needed.
The G q heads of the kv head are rows, so their contributions are summed
into the one kv head for free (GQA).

The q-side operands of one (batch, kv head) are whole blocks (`[nQ, bq, D]`)
indexed by the loop: fine for the training layout (rows = anchors * bs * G);
on TPU they live in VMEM, so very long row counts need a smaller problem per
call.
"""

from __future__ import annotations

import functools

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
  from jax.experimental.pallas import tpu as pltpu
  if mode == "extra":
    kg_ref, refs = refs[0], refs[1:]
  rows, (dk_ref, dv_ref), scratch = refs[:5], refs[5:7], refs[7:]
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  if mode == "cache":
    # The cache block of kv head h is strided in HBM ([B, S, K, D]): fetch
    # it with two DMAs instead of a BlockSpec over the head axis.
    kbuf, vbuf, sem = scratch
    rows_j = pl.ds(pl.multiple_of(j * cfg.bk, cfg.bk), cfg.bk)
    copies = (pltpu.make_async_copy(k_ref.at[b, rows_j, h], kbuf, sem.at[0]),
              pltpu.make_async_copy(v_ref.at[b, rows_j, h], vbuf, sem.at[1]))
    for c in copies:
      c.start()
    for c in copies:
      c.wait()
    k, v, kg = kbuf[...], vbuf[...], None
    t = b * cfg.n_k + j
  else:
    k, v, kg = k_ref[...], v_ref[...], kg_ref[...]
    t = j
  dk, dv = _col_body(cfg, mode, j, k, v, kg, rows, lo_ref[t], hi_ref[t])
  dk_ref[...] = dk
  dv_ref[...] = dv


def col_call(cfg: C.Cfg, mode, k, v, kg, rows, tables):
  """dK, dV for the cache ("cache") or the extra keys ("extra").

  Args (kernel layout):
    k, v: cache `[B, Sp, K, D]` or extra `[B, K, nE, be, D]`;
    kg: extra key groups as columns `[nE, be, 1]` (extra mode) or None;
    rows: (q5, do5 `[B, K, nQ, bq, D]`, lseT, deltaT `[B, K, nQ, 1, bq]`,
      visT: limits `[B, nQ, 1, bq]` (cache) or row groups `[nQ, 1, bq]`);
    tables: (q_lo, q_hi) `[B, nK]` (cache) or `[nE]` (extra).
  Returns: (dk, dv) fp32 `[B, K, n_blocks, block, D]`.
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
  if mode == "cache" and tpu:
    kv_specs = [pl.BlockSpec(memory_space=pl.ANY)] * 2
  elif mode == "cache":
    kv_specs = [pl.BlockSpec((None, blk, None, D),
                             lambda b, h, j, *_: (b, j, h, 0))] * 2
  else:
    kv_specs = [pl.BlockSpec((None, None, None, blk, D),
                             lambda b, h, j, *_: (b, h, j, 0, 0))] * 2
  in_specs = list(kv_specs)
  args = [k, v]
  if mode == "extra":
    in_specs.append(pl.BlockSpec((None, blk, 1), lambda b, h, j, *_: (j, 0, 0)))
    args.append(kg)
  in_specs += row_specs
  args += list(rows)
  out_spec = pl.BlockSpec((None, None, None, blk, D),
                          lambda b, h, j, *_: (b, h, j, 0, 0))
  out_shape = (jax.ShapeDtypeStruct((B, K, nb, blk, D), jnp.float32),) * 2
  q_lo, q_hi = tables

  if tpu:
    from jax.experimental.pallas import tpu as pltpu
    scratch = []
    if mode == "cache":
      scratch = [pltpu.VMEM((blk, D), k.dtype), pltpu.VMEM((blk, D), v.dtype),
                 pltpu.SemaphoreType.DMA((2,))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=grid, in_specs=in_specs,
        out_specs=(out_spec, out_spec), scratch_shapes=scratch)
    call = pl.pallas_call(
        functools.partial(_kernel_tpu, cfg, mode), grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=_platform.compiler_params(cfg, 3),
        interpret=_platform.interpret_arg(cfg),
        name=f"flexdraft_attn_d{mode}")
    return call(q_lo.reshape(-1), q_hi.reshape(-1), *args)

  full = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  in_specs += [full(q_lo.shape), full(q_hi.shape)]
  call = pl.pallas_call(
      functools.partial(_kernel_gpu, cfg, mode), grid=grid,
      in_specs=in_specs, out_specs=(out_spec, out_spec), out_shape=out_shape,
      compiler_params=_platform.compiler_params(cfg, 3),
      interpret=_platform.interpret_arg(cfg),
      name=f"flexdraft_attn_d{mode}")
  return call(*args, q_lo, q_hi)
