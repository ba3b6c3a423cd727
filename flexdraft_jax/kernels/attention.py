"""Pallas kernels for FlexDraft's one attention primitive (see
flexdraft_jax/model/attention.py): cache keys visible up to a per-row
position limit, transient extra (mask) keys visible by group id.

`attend_pallas` has `attend_xla`'s signature and semantics (fp32 softmax,
GQA without repeated K/V, rows that see no key return zeros) and is
differentiable: a `jax.custom_vjp` with Pallas kernels for the forward,
dq, dK/dV of the cache and dK/dV of the extra keys.

Kernel layout: the G = N/K q heads of one kv head are folded into rows
(row = token * G + head-in-group), so one program serves (batch, kv head,
q block) and every K/V block it reads is shared by its G heads. The cache
comes in `attend_xla`'s kv-head-major layout `[B, K, S, D]` and is used as
is (no transpose): the cache of one (batch, kv head) is a contiguous
`[S, D]` slab, so every cache block a program reads (a Triton load, a TPU
DMA or BlockSpec block) is one contiguous `[block_k, D]` tile. The cache
gradients come back in the same layout.

Kernels (all `pl.pallas_call`):
  forward / dq   grid (B, K, nQ): loop over cache blocks `0..n_blocks` —
                 blocks past every row's limit are neither read nor
                 computed — then over the extra blocks whose groups some
                 row of the block belongs to. Online softmax in fp32.
  dK/dV (cache)  grid (B, K, nK): loop over the q blocks that see the block.
  dK/dV (extra)  grid (B, K, nE): loop over the q blocks of its groups.
Backends (`backend=`): "gpu" — Triton lowering (pointer loads, dynamic
trip counts); "tpu" — Mosaic (forward / dq: cache in HBM, double-buffered
async DMA of contiguous blocks into VMEM; dK/dV: BlockSpec-pipelined blocks;
schedule tables in SMEM via scalar prefetch); "auto" — the one of the
platform programs are built for (`_platform.platform()`: the default backend's,
or a TPU inside `_platform.building_for("tpu")`; gpu-structured on CPU).
`interpret=None` runs the
interpreter when the platform can't compile the backend (CPU), using TPU
interpret mode (`pltpu.InterpretParams`) for the TPU kernels.

Cotangents: the backward returns exact gradients for q, k, v, xk and xv
(integer inputs get none). Only the cotangents of inputs that are being
differentiated are computed (custom_vjp `symbolic_zeros`): with a frozen
cache (training: stop_gradient / not a grad argument) the cache dK/dV
kernel is not run at all.

Precision: matmuls run in the inputs' promoted dtype with fp32 accumulation
(fp32 inputs: HIGHEST precision, matching the reference to ~1e-6); with
bf16 inputs the probabilities are rounded to bf16 before P@V, as usual for
flash attention, so results differ from the fp32-softmax reference at the
bf16 rounding level.

Draft trees (`tree=(start_B, anc_BxTxT)`, as `attend_xla` takes it): each
row carries its ancestors as a bitmask (`ceil(T / 32)` int32 words, bit u
of token t's mask = anc[t, u]) and its tree's `start`; the forward's cache
loop masks out the tree slots `start .. start + T - 1` whose bit is clear.
A static flag (`Cfg.tree_nodes`): without a tree the kernels are compiled
exactly as before. Forward only — decoding verifies trees, training has
none — so differentiating through a tree is refused.

Caches whose length is not a multiple of the key block are padded (a copy);
size production caches in multiples of `block_k`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from flexdraft_jax.kernels import _common as C
from flexdraft_jax.kernels import _platform
from flexdraft_jax.kernels._col import col_call
from flexdraft_jax.kernels._row import row_call
from flexdraft_jax.util import ceil_div, round_up

# (block_q, block_k, block_e) per backend.
# TPU has no cache between HBM and VMEM: every q block re-reads the visible
# K/V, so its q blocks are large (decode rows of a kv head fit in 1-3).
DEFAULT_BLOCKS = {"gpu": (64, 64, 64), "tpu": (512, 512, 128)}


def _next_pow2(x):
  return 1 << max(0, int(x) - 1).bit_length()


def _fit_block(block, n, backend, interpret):
  """Shrinks `block` to the problem size under the backend's constraints."""
  if backend == "gpu":
    # Triton: power-of-two tiles, matmul dims >= 16.
    fitted = min(block, max(16, _next_pow2(n)))
    if not interpret and (fitted < 16 or fitted & (fitted - 1)):
      raise ValueError(f"gpu block sizes must be powers of two >= 16: {block}")
    return fitted
  # Mosaic: sublane-aligned (8) tiles of any size; balance the blocks so
  # the padding stays under 8 per block (decode rows: 1088 -> 3 x 368).
  if not interpret and block % 8:
    raise ValueError(f"tpu block sizes must be multiples of 8: {block}")
  n = max(n, 1)
  n_blocks = ceil_div(n, block)
  return min(block, round_up(ceil_div(n, n_blocks), 8))


def _pad_axis(x, axis, size, value=0):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _first_last(vis_AxB):
  """Per row of a bool matrix: [first True, last True + 1), (0, 0) if none."""
  n = vis_AxB.shape[1]
  any_ = vis_AxB.any(axis=1)
  lo = jnp.argmax(vis_AxB, axis=1)
  hi = n - jnp.argmax(vis_AxB[:, ::-1], axis=1)
  return (jnp.where(any_, lo, 0).astype(jnp.int32),
          jnp.where(any_, hi, 0).astype(jnp.int32))


def _schedule(cfg: C.Cfg, lim_BxR, qg_R, kg_E):
  """Integer tables telling each program which blocks it must visit."""
  B = lim_BxR.shape[0]
  blk_max = lim_BxR.reshape(B, cfg.n_q, cfg.bq).max(axis=2)
  nblk = jnp.clip((blk_max + cfg.bk) // cfg.bk, 0, cfg.n_k).astype(jnp.int32)
  touch = nblk[:, :, None] > jnp.arange(cfg.n_k)[None, None, :]   # B,nQ,nK
  qlo_c, qhi_c = _first_last(
      jnp.swapaxes(touch, 1, 2).reshape(B * cfg.n_k, cfg.n_q))
  tables = {"nblk": nblk,
            "qlo_c": qlo_c.reshape(B, cfg.n_k),
            "qhi_c": qhi_c.reshape(B, cfg.n_k)}
  if cfg.has_extra:
    same = (qg_R[:, None] >= 0) & (qg_R[:, None] == kg_E[None, :])
    vis = same.reshape(cfg.n_q, cfg.bq, cfg.n_e, cfg.be).any(axis=(1, 3))
    tables["elo"], tables["ehi"] = _first_last(vis)
    tables["qlo_e"], tables["qhi_e"] = _first_last(vis.T)
  else:
    z = jnp.zeros((cfg.n_q,), jnp.int32)
    tables["elo"] = tables["ehi"] = z
  return tables


def _fwd(cfg: C.Cfg, q, k, v, xk, xv, ints):
  out, lse = row_call(
      cfg, q, ints["lim"][..., None], ints["qg"][:, None], k, v, xk, xv,
      ints["kg"].reshape(cfg.n_e, 1, cfg.be) if cfg.has_extra else None,
      (ints["nblk"], ints["elo"], ints["ehi"]), out_dtype=q.dtype,
      tree=(ints["tstart"], ints["tbits"]) if cfg.tree_nodes else None)
  return out, lse


def _tree_rows(cfg: C.Cfg, start_B, anc_BxTxT, G: int, Rp: int):
  """The kernel's tree inputs: start per row `[B, Rp, 1]` and the ancestor
  bitmask per row `[B, W, Rp, 1]` int32 (row t·G + g gets token t's mask;
  padded rows none)."""
  B, T = anc_BxTxT.shape[:2]
  W = cfg.tree_words
  bits = _pad_axis(anc_BxTxT.astype(jnp.uint32), 2, W * 32).reshape(B, T, W, 32)
  words = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1)  # disjoint
  words = jax.lax.bitcast_convert_type(words, jnp.int32)               # B,T,W
  words = _pad_axis(jnp.repeat(words, G, axis=1), 1, Rp)
  start = jnp.broadcast_to(start_B.astype(jnp.int32)[:, None, None], (B, Rp, 1))
  return start, jnp.swapaxes(words, 1, 2)[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, xk, xv, ints):
  return _fwd(cfg, q, k, v, xk, xv, ints)[0]


def _core_fwd(cfg, q, k, v, xk, xv, ints):
  # symbolic_zeros=True: leaves arrive as CustomVJPPrimal(value, perturbed).
  # Cotangents of unperturbed inputs (e.g. the frozen cache in training) are
  # never computed: their kernels are not even traced into the backward.
  val = lambda x: None if x is None else x.value
  pert = lambda x: x is not None and x.perturbed
  need = (pert(q), pert(k) or pert(v), pert(xk) or pert(xv))
  q, k, v, xk, xv = map(val, (q, k, v, xk, xv))
  ints = jax.tree.map(val, ints)
  if cfg.tree_nodes and any(need):
    raise NotImplementedError("attend_pallas has no backward with a draft tree "
                              "(tree=...): differentiate attend_xla instead")
  out, lse = _fwd(cfg, q, k, v, xk, xv, ints)
  return out, (need, q, k, v, xk, xv, ints, out, lse)


def _core_bwd(cfg, res, do):
  (need_q, need_kv, need_x), q, k, v, xk, xv, ints, out, lse = res
  if isinstance(do, jax.custom_derivatives.SymbolicZero):
    do = jnp.zeros(out.shape, out.dtype)
  B, K, Rp, D = q.shape
  nQ, bq = cfg.n_q, cfg.bq
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1,
                  keepdims=True)
  dq = dk = dv = dxk = dxv = None
  if need_q:
    kg3 = ints["kg"].reshape(cfg.n_e, 1, cfg.be) if cfg.has_extra else None
    (dq,) = row_call(cfg, q, ints["lim"][..., None], ints["qg"][:, None],
                     k, v, xk, xv, kg3,
                     (ints["nblk"], ints["elo"], ints["ehi"]),
                     stats=(do, lse, delta))
    dq = dq.astype(q.dtype)
  as_t = lambda x: x.reshape(B, K, nQ, 1, bq)
  rows = (q.reshape(B, K, nQ, bq, D), do.reshape(B, K, nQ, bq, D),
          as_t(lse), as_t(delta))
  if need_kv:
    dk4, dv4 = col_call(cfg, "cache", k, v, None,
                        rows + (ints["lim"].reshape(B, nQ, 1, bq),),
                        (ints["qlo_c"], ints["qhi_c"]))
    dk, dv = dk4.astype(k.dtype), dv4.astype(v.dtype)   # [B, K, Sp, D]
  if cfg.has_extra and need_x:
    dxk5, dxv5 = col_call(cfg, "extra", xk, xv,
                          ints["kg"].reshape(cfg.n_e, cfg.be, 1),
                          rows + (ints["qg"].reshape(nQ, 1, bq),),
                          (ints["qlo_e"], ints["qhi_e"]))
    dxk, dxv = dxk5.astype(xk.dtype), dxv5.astype(xv.dtype)
  return dq, dk, dv, dxk, dxv, None


_core.defvjp(_core_fwd, _core_bwd, symbolic_zeros=True)


def attend_pallas(q_BxTxNxD, k_BxKxSxD, v_BxKxSxD, limit_BxT,
                  xk_BxExKxD=None, xv_BxExKxD=None,
                  q_group_T: Optional[jax.Array] = None,
                  k_group_E: Optional[jax.Array] = None, *,
                  backend: str = "auto", interpret: Optional[bool] = None,
                  block_q: Optional[int] = None, block_k: Optional[int] = None,
                  block_e: Optional[int] = None, tree=None):
  """`attend_xla` as Pallas kernels (same arguments, same `[B, T, N, D]`).

  The cache `k_BxKxSxD`, `v_BxKxSxD` is kv-head major (`[B, K, S, D]`, as in
  `attend_xla`) and is read in place; its gradients have the same layout.

  Keyword-only extras: `backend` ("auto" | "gpu" | "tpu"), `interpret`
  (None: only where the platform can't compile the backend), and the block
  sizes (rows of q — tokens x q-heads-per-kv-head —, cache keys, extra keys;
  defaults per backend in DEFAULT_BLOCKS, shrunk to small problems).

  `tree` = (start_B, anc_BxTxT): the queries are a draft tree's rows, as in
  `attend_xla` (forward only: differentiating through a tree raises
  NotImplementedError; `attend_xla` has the gradient).
  """
  q = q_BxTxNxD
  B, T, N, D = q.shape
  K, S = k_BxKxSxD.shape[1], k_BxKxSxD.shape[2]
  if N % K:
    raise ValueError(f"{N} q heads are not a multiple of {K} kv heads")
  G = N // K
  backend = _platform.resolve_backend(backend)
  interp = _platform.resolve_interpret(backend, interpret)
  has_x = xk_BxExKxD is not None and xk_BxExKxD.shape[1] > 0
  E = xk_BxExKxD.shape[1] if has_x else 0
  if T == 0:
    return jnp.zeros(q.shape, q.dtype)
  if tree is not None and tuple(tree[1].shape) != (B, T, T):
    raise ValueError(f"a tree of {T} rows needs ancestors [{B}, {T}, {T}], "
                     f"got {tuple(tree[1].shape)}")
  if backend == "gpu" and not interp and D & (D - 1):
    raise ValueError(f"the Triton kernels need a power-of-two head_dim: {D}")

  dq_, dk_, de_ = DEFAULT_BLOCKS[backend]
  R = T * G
  bq = _fit_block(block_q or dq_, R, backend, interp)
  bk = _fit_block(block_k or dk_, S, backend, interp)
  be = _fit_block(block_e or de_, E, backend, interp) if has_x else 8
  Rp, Sp = round_up(R, bq), round_up(max(S, 1), bk)
  Ep = round_up(E, be) if has_x else 0
  dtypes = [q.dtype, k_BxKxSxD.dtype, v_BxKxSxD.dtype]
  if has_x:
    dtypes += [xk_BxExKxD.dtype, xv_BxExKxD.dtype]
  cfg = C.Cfg(backend=backend, interpret=interp, scale=float(D) ** -0.5,
              bq=bq, bk=bk, be=be, n_q=Rp // bq, n_k=Sp // bk,
              n_e=Ep // be if has_x else 0,
              compute_dtype=jnp.dtype(jnp.result_type(*dtypes)).name,
              tree_nodes=T if tree is not None else 0)

  # Rows: (token, head-in-group), padded rows see nothing.
  qr = q.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4).reshape(B, K, R, D)
  qr = _pad_axis(qr, 2, Rp)
  lim = jnp.clip(limit_BxT.astype(jnp.int32), -1, S - 1)
  lim = _pad_axis(jnp.repeat(lim, G, axis=1), 1, Rp, -1)
  k = _pad_axis(k_BxKxSxD, 2, Sp)   # [B, K, Sp, D]: no-op when S % bk == 0
  v = _pad_axis(v_BxKxSxD, 2, Sp)
  xk = xv = None
  if has_x:
    qg = _pad_axis(jnp.repeat(q_group_T.astype(jnp.int32), G), 0, Rp, -1)
    kg = _pad_axis(k_group_E.astype(jnp.int32), 0, Ep, C.PAD_KEY_GROUP)
    to_blocks = lambda x: _pad_axis(jnp.transpose(x, (0, 2, 1, 3)), 2, Ep
                                    ).reshape(B, K, cfg.n_e, be, D)
    xk, xv = to_blocks(xk_BxExKxD), to_blocks(xv_BxExKxD)
  else:
    qg = jnp.full((Rp,), -1, jnp.int32)
    kg = jnp.zeros((0,), jnp.int32)
  ints = {"lim": lim, "qg": qg, "kg": kg, **_schedule(cfg, lim, qg, kg)}
  if tree is not None:
    ints["tstart"], ints["tbits"] = _tree_rows(cfg, *tree, G, Rp)

  out = _core(cfg, qr, k, v, xk, xv, ints)
  out = out[:, :, :R].reshape(B, K, T, G, D).transpose(0, 2, 1, 3, 4)
  return out.reshape(B, T, N, D)
