"""Math shared by every Pallas attention kernel (forward, dq, dk/dv).

All functions here operate on *values* already loaded inside a kernel, so the
same code lowers through Triton (GPU), Mosaic (TPU) and the interpreters.
Conventions (kernel layout, see attention.py):
  * a "row" is one (token, q-head-of-this-kv-head) pair: `R = T * G` rows;
  * row vectors inside a row kernel are columns `(bq, 1)`; inside a column
    kernel (dk/dv) everything is transposed: scores are `(bk, bq)` and the
    per-row statistics are lane-dense `(1, bq)`;
  * `lse` of a row that sees no key is `EMPTY_LSE` (so `exp(s - lse) == 0`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

NEG_INF = -1e30     # finite "minus infinity" (as in attend_xla)
EMPTY_LSE = 1e30    # lse of a row that sees no key: every p becomes 0
PAD_KEY_GROUP = -2  # group id of padded extra keys (never visible)

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class Cfg:
  """Static configuration of one attention call (hashable: custom_vjp arg)."""
  backend: str          # "tpu" | "gpu"
  interpret: bool       # run under an interpreter (CPU)
  scale: float          # softmax scale, D ** -0.5
  bq: int               # rows per q block
  bk: int               # cache keys per block
  be: int               # extra keys per block
  n_q: int              # q blocks
  n_k: int              # cache key blocks
  n_e: int              # extra key blocks (0: no extra keys)
  compute_dtype: str    # dtype the matmuls run in (fp32 accumulation)
  tree_nodes: int = 0   # rows are a draft tree of this many nodes (0: none)

  @property
  def has_extra(self) -> bool:
    return self.n_e > 0

  @property
  def tree_words(self) -> int:
    """int32 words of one row's ancestor bitmask (0 without a tree)."""
    return -(-self.tree_nodes // 32)

  @property
  def precision(self):
    # fp32 inputs: full-precision matmuls (no TF32 / single-pass bf16), so
    # the kernel matches the fp32 reference; bf16 inputs: native MXU/TC.
    if jnp.dtype(self.compute_dtype) == jnp.float32:
      return lax.Precision.HIGHEST
    return lax.Precision.DEFAULT


def dot_nt(cfg: Cfg, a, b):
  """a @ b.T with fp32 accumulation, operands in the compute dtype."""
  dt = jnp.dtype(cfg.compute_dtype)
  return lax.dot_general(a.astype(dt), b.astype(dt), _NT,
                         precision=cfg.precision,
                         preferred_element_type=jnp.float32)


def dot_nn(cfg: Cfg, a, b):
  """a @ b with fp32 accumulation, operands in the compute dtype."""
  dt = jnp.dtype(cfg.compute_dtype)
  return lax.dot_general(a.astype(dt), b.astype(dt), _NN,
                         precision=cfg.precision,
                         preferred_element_type=jnp.float32)


# ---------------------------------------------------------------- masks ----

def cache_mask_rows(j, bk, lim_Qx1):
  """(bq, bk): row may see cache slot `j*bk + c` iff slot <= its limit."""
  col = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  return col <= lim_Qx1


def cache_mask_cols(j, bk, lim_1xQ):
  """Transposed cache mask (bk, bq) for the column (dk/dv) kernel."""
  col = j * bk + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
  return col <= lim_1xQ


def tree_mask_rows(j, bk, n_nodes, start_Qx1, words):
  """(bq, bk): a draft tree's visibility of cache slots `j*bk + c`.

  The tree's `n_nodes` rows own slots `start .. start + n_nodes - 1`; a row
  sees such a slot iff bit `slot - start` of its ancestor mask is set (bit b
  of the mask is bit `b % 32` of `words[b // 32]`, each word a `(bq, 1)`
  int32 column). Slots outside the tree are left to the limit mask (True).
  The words are walked statically (a few per row), so no gather is needed.
  """
  col = j * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  rel = col - start_Qx1                                        # (bq, bk)
  in_tree = (rel >= 0) & (rel < n_nodes)
  word_of, bit_of = jnp.right_shift(rel, 5), rel & 31
  anc = jnp.zeros(rel.shape, jnp.bool_)
  for w, word_Qx1 in enumerate(words):
    bit = jnp.right_shift(word_Qx1, bit_of) & 1
    anc = anc | ((word_of == w) & (bit != 0))
  return anc | ~in_tree


def group_mask(qg, kg):
  """Extra key visible iff the row is in a group and the groups match.

  Works in both orientations: (bq,1) x (1,be) or (be,1) x (1,bq) — with the
  row groups given as `qg` either way.
  """
  return (qg >= 0) & (qg == kg)


# ------------------------------------------------------ forward (rows) ----

def fwd_init(bq, d):
  return (jnp.full((bq, 1), NEG_INF, jnp.float32),
          jnp.zeros((bq, 1), jnp.float32),
          jnp.zeros((bq, d), jnp.float32))


def fwd_step(cfg: Cfg, carry, q, k, v, mask):
  """One online-softmax update with a key block (masked entries ignored)."""
  m, l, acc = carry
  s = dot_nt(cfg, q, k) * cfg.scale
  s = jnp.where(mask, s, NEG_INF)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
  alpha = jnp.exp(m - m_new)
  l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
  acc = alpha * acc + dot_nn(cfg, p, v)
  return m_new, l, acc


def fwd_finish(carry):
  """-> (out (bq, D) fp32, lse (bq, 1) fp32); rows with no key give 0."""
  m, l, acc = carry
  seen = l > 0.0
  out = acc / jnp.where(seen, l, 1.0)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), EMPTY_LSE)
  return out, lse


# ----------------------------------------------------------- dq (rows) ----

def dq_step(cfg: Cfg, dq, q, k, v, mask, do, lse, delta):
  """dq += dS @ K for one key block (unscaled; see dq_finish)."""
  s = dot_nt(cfg, q, k) * cfg.scale
  p = jnp.where(mask, jnp.exp(s - lse), 0.0)
  dp = dot_nt(cfg, do, v)
  ds = p * (dp - delta)
  return dq + dot_nn(cfg, ds, k)


# ---------------------------------------------- dk / dv (columns, T) ----

def dkv_step(cfg: Cfg, carry, k, v, q, do, lse_1xQ, delta_1xQ, mask_KxQ):
  """dK += dS^T Q, dV += P^T dO for one q block, computed transposed."""
  dk, dv = carry
  s_t = dot_nt(cfg, k, q) * cfg.scale                       # (bk, bq)
  p_t = jnp.where(mask_KxQ, jnp.exp(s_t - lse_1xQ), 0.0)
  dv = dv + dot_nn(cfg, p_t, do)
  dp_t = dot_nt(cfg, v, do)
  ds_t = p_t * (dp_t - delta_1xQ)
  dk = dk + dot_nn(cfg, ds_t, q)
  return dk, dv
