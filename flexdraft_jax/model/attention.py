"""The one attention primitive every layout in FlexDraft reduces to.

Keys come from two places:
  * the KV cache `k_BxKxSxD` (kv-head major, so the score and value matmuls
    batch over (B, K) with no transpose of the cache), indexed by *position*:
    query row t of sequence b
    may see cache slot j iff `j <= limit_BxT[b, t]` (a limit of -1 sees none);
  * "extra" keys `xk_BxExKxD` (the transient mask-token K/V): query row t may
    see extra key e iff `q_group_T[t] >= 0 and q_group_T[t] == k_group_E[e]`.

With this, the layouts of SPEC §2/§4 are all one call:
  clean rows (prefill, verify):  limit = own position, group -1;
  mask group g in parallel mode: limit = c + g, group g (bidirectional inside);
  training anchor block k:       limit = anchor_k, group k.

`attend` dispatches on `impl`: "xla" (this file, the reference), "pallas"
(flexdraft_jax/kernels) or "auto" (Pallas on TPU/GPU, XLA on CPU).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def tree_visible(visible_BxRxC, slot_C, tree, G: int):
  """`visible` with the cache slots of a draft tree's rows narrowed to each
  row's ancestors (`tree` = (start_B, anc_BxTxT): the T rows of the tree sit
  in slots start .. start + T - 1, row t sees row u iff anc[t, u]); None
  leaves `visible` as it is. Slots `slot_C` are the columns of `visible`."""
  if tree is None:
    return visible_BxRxC
  start_B, anc_BxTxT = tree
  T = anc_BxTxT.shape[1]
  rel_BxC = slot_C[None, :] - start_B[:, None]
  in_tree_BxC = (rel_BxC >= 0) & (rel_BxC < T)
  # [B, T, C]: row t sees tree slot rel iff anc[t, rel]; rows r = t·G + g
  anc_BxTxC = jnp.take_along_axis(
      anc_BxTxT, jnp.broadcast_to(jnp.clip(rel_BxC, 0, T - 1)[:, None, :],
                                  (anc_BxTxT.shape[0], T, rel_BxC.shape[1])), axis=2)
  ok_BxRxC = jnp.repeat(anc_BxTxC | ~in_tree_BxC[:, None, :], G, axis=1)
  return visible_BxRxC & ok_BxRxC


def attend_xla(q_BxTxNxD, k_BxKxSxD, v_BxKxSxD, limit_BxT,
               xk_BxExKxD=None, xv_BxExKxD=None,
               q_group_T=None, k_group_E=None, *, extra_block=None, tree=None):
  """Reference attention (fp32 softmax); GQA without repeating K/V.

  `extra_block` (static): the queries are exactly the extra keys' rows and
  form contiguous groups of `extra_block` rows (training's anchor blocks:
  group_T = group_E = [0]*bs + [1]*bs + ...). Each row then scores only the
  extra keys of its own block, `[T, bs]` instead of `[T, T]` — the same
  result, without a score matrix that grows with the square of the rows.

  `tree` = (start_B, anc_BxTxT): the queries are a draft tree's rows, whose
  K/V sit in cache slots start .. start + T - 1; row t sees those slots of
  its ancestors only (`tree_visible`), and every slot before `start`.

  Returns `[B, T, N, D]` in q's dtype. A row that sees no key returns zeros.
  """
  B, T, N, D = q_BxTxNxD.shape
  K, S = k_BxKxSxD.shape[1], k_BxKxSxD.shape[2]
  G = N // K
  # Rows r = (t, g): the G q heads of one kv head share its keys.
  q_BxKxRxD = (q_BxTxNxD.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4)
               .reshape(B, K, T * G, D) * (D ** -0.5))
  limit_BxR = jnp.repeat(limit_BxT, G, axis=1)
  s_BxKxRxS = jnp.einsum("BKRD,BKSD->BKRS", q_BxKxRxD, k_BxKxSxD,
                         preferred_element_type=jnp.float32)
  visible_BxRxS = tree_visible(jnp.arange(S)[None, None, :] <= limit_BxR[:, :, None],
                               jnp.arange(S), tree, G)
  # (scores, values, einsum of weights x values) per key source: the cache,
  # then the extra keys. The softmax runs over both without concatenating
  # them, and normalises after the value products ([R, D], not [R, S]).
  parts = [(jnp.where(visible_BxRxS[:, None], s_BxKxRxS, NEG_INF), v_BxKxSxD,
            lambda p, v: jnp.einsum("BKRS,BKSD->BKRD", p, v,
                                    preferred_element_type=jnp.float32))]
  if xk_BxExKxD is not None and xk_BxExKxD.shape[1] > 0:
    xk_BxKxExD, xv_BxKxExD = (x.transpose(0, 2, 1, 3) for x in (xk_BxExKxD, xv_BxExKxD))
    if extra_block:
      E, n = xk_BxKxExD.shape[2], T // extra_block
      if T % extra_block or E != T:
        raise ValueError(f"extra_block={extra_block} needs the {T} query rows to be "
                         f"the extra keys' rows, {E} of them, in whole blocks")
      # Row r = t·G + g with t = i·block + j: a block's rows are contiguous.
      blocks = lambda x, rows: x.reshape(B, K, n, rows, x.shape[-1])
      x_BxKxRxE = jnp.einsum(
          "BKnPD,BKnCD->BKnPC", blocks(q_BxKxRxD, extra_block * G),
          blocks(xk_BxKxExD, extra_block),
          preferred_element_type=jnp.float32).reshape(B, K, T * G, extra_block)
      product = lambda p, v: jnp.einsum(
          "BKnPC,BKnCD->BKnPD", blocks(p, extra_block * G), blocks(v, extra_block),
          preferred_element_type=jnp.float32).reshape(B, K, T * G, D)
    else:
      x_BxKxRxE = jnp.einsum("BKRD,BKED->BKRE", q_BxKxRxD, xk_BxKxExD,
                             preferred_element_type=jnp.float32)
      q_group_R = jnp.repeat(q_group_T, G)
      same_RxE = (q_group_R[:, None] >= 0) & (q_group_R[:, None] == k_group_E[None, :])
      x_BxKxRxE = jnp.where(same_RxE[None, None], x_BxKxRxE, NEG_INF)
      product = lambda p, v: jnp.einsum("BKRE,BKED->BKRD", p, v,
                                        preferred_element_type=jnp.float32)
    parts.append((x_BxKxRxE, xv_BxKxExD, product))
  # Softmax over all parts' keys; keys at NEG_INF get 0, a row with none all 0.
  m_BxKxRx1 = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True)
                                             for s, _, _ in parts])
  weights = [jnp.where(s > NEG_INF / 2, jnp.exp(s - m_BxKxRx1), 0.0) for s, _, _ in parts]
  denom_BxKxRx1 = sum(jnp.sum(w, axis=-1, keepdims=True) for w in weights)
  o_BxKxRxD = sum(product(w.astype(v.dtype), v) for w, (_, v, product) in zip(weights, parts))
  o_BxKxRxD = o_BxKxRxD / jnp.where(denom_BxKxRx1 > 0, denom_BxKxRx1, 1.0)
  o = o_BxKxRxD.reshape(B, K, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, N, D)
  return o.astype(q_BxTxNxD.dtype)


def attend_xla_blocked(q_BxTxNxD, k_BxKxSxD, v_BxKxSxD, limit_BxT,
                       xk_BxExKxD=None, xv_BxExKxD=None,
                       q_group_T=None, k_group_E=None, *, kv_block: int = 256,
                       tree=None):
  """`attend_xla` reading only the cache blocks some row can see.

  A `lax.while_loop` over key blocks up to the largest limit with an online
  softmax, so a decode step costs the live length, not the cache capacity.
  Forward only (not reverse-differentiable): the decoding engine's path.
  """
  B, T, N, D = q_BxTxNxD.shape
  K, S = k_BxKxSxD.shape[1], k_BxKxSxD.shape[2]
  G, R = N // K, T * N // K
  if S % kv_block:
    return attend_xla(q_BxTxNxD, k_BxKxSxD, v_BxKxSxD, limit_BxT,
                      xk_BxExKxD, xv_BxExKxD, q_group_T, k_group_E, tree=tree)
  q = (q_BxTxNxD.reshape(B, T, K, G, D).transpose(0, 2, 1, 3, 4)
       .reshape(B, K, R, D) * (D ** -0.5))
  limit_BxR = jnp.repeat(limit_BxT, G, axis=1)

  def update(carry, s_BxKxRxC, v_BxKxCxD):
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s_BxKxRxC, axis=-1))
    p = jnp.where(s_BxKxRxC > NEG_INF / 2, jnp.exp(s_BxKxRxC - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    acc = acc * alpha[..., None] + jnp.einsum(
        "BKRC,BKCD->BKRD", p.astype(v_BxKxCxD.dtype), v_BxKxCxD,
        preferred_element_type=jnp.float32)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc

  def body(j, carry):
    start = j * kv_block
    kb = jax.lax.dynamic_slice_in_dim(k_BxKxSxD, start, kv_block, axis=2)
    vb = jax.lax.dynamic_slice_in_dim(v_BxKxSxD, start, kv_block, axis=2)
    s = jnp.einsum("BKRD,BKCD->BKRC", q, kb, preferred_element_type=jnp.float32)
    slots = start + jnp.arange(kv_block)
    visible = tree_visible(slots[None, None, :] <= limit_BxR[:, :, None], slots, tree, G)
    return update(carry, jnp.where(visible[:, None], s, NEG_INF), vb)

  carry = (jnp.full((B, K, R), NEG_INF, jnp.float32), jnp.zeros((B, K, R), jnp.float32),
           jnp.zeros((B, K, R, D), jnp.float32))
  n_blocks = jnp.clip(jnp.max(limit_BxT) // kv_block + 1, 0, S // kv_block)
  carry = jax.lax.fori_loop(0, n_blocks, body, carry)
  if xk_BxExKxD is not None and xk_BxExKxD.shape[1] > 0:
    s = jnp.einsum("BKRD,BEKD->BKRE", q, xk_BxExKxD, preferred_element_type=jnp.float32)
    q_group_R = jnp.repeat(q_group_T, G)
    same_RxE = (q_group_R[:, None] >= 0) & (q_group_R[:, None] == k_group_E[None, :])
    carry = update(carry, jnp.where(same_RxE[None, None], s, NEG_INF),
                   xv_BxExKxD.transpose(0, 2, 1, 3))
  _, l, acc = carry
  o = acc / jnp.where(l > 0, l, 1.0)[..., None]
  o = o.reshape(B, K, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, N, D)
  return o.astype(q_BxTxNxD.dtype)


def resolve_impl(impl: str) -> str:
  """"auto" -> "pallas" where programs are built for a TPU or GPU
  (`kernels._platform.platform()`), else "xla"."""
  if impl == "auto":
    from flexdraft_jax.kernels import _platform
    return "pallas" if _platform.platform() in ("tpu", "gpu") else "xla"
  if impl not in ("xla", "pallas"):
    raise ValueError(f"attention_impl must be xla, pallas or auto, got {impl!r}")
  return impl


def attend(q_BxTxNxD, k_BxKxSxD, v_BxKxSxD, limit_BxT,
           xk_BxExKxD=None, xv_BxExKxD=None,
           q_group_T: Optional[jax.Array] = None,
           k_group_E: Optional[jax.Array] = None, *, impl: str = "xla",
           kv_block: Optional[int] = None, extra_block: Optional[int] = None,
           tree=None):
  """Attention under the position-limit + group layout (see module doc).

  `kv_block` (xla only): read the cache in blocks up to the largest limit
  (decoding); None reads it whole (differentiable: training).
  `extra_block` (xla, whole-cache path): the queries are the extra keys' rows
  in contiguous groups of that many rows (see `attend_xla`).
  `tree` (start_B, anc_BxTxT): the queries are a draft tree's rows (see
  `attend_xla`); the Pallas kernels apply it in their forward (ancestor
  bitmasks per row) and refuse to differentiate through it.
  """
  if resolve_impl(impl) == "pallas":
    from flexdraft_jax.kernels import attention as pallas_attention
    return pallas_attention.attend_pallas(
        q_BxTxNxD, k_BxKxSxD, v_BxKxSxD, limit_BxT,
        xk_BxExKxD, xv_BxExKxD, q_group_T, k_group_E, tree=tree)
  if kv_block:
    return attend_xla_blocked(q_BxTxNxD, k_BxKxSxD, v_BxKxSxD, limit_BxT,
                              xk_BxExKxD, xv_BxExKxD, q_group_T, k_group_E,
                              kv_block=kv_block, tree=tree)
  return attend_xla(q_BxTxNxD, k_BxKxSxD, v_BxKxSxD, limit_BxT,
                    xk_BxExKxD, xv_BxExKxD, q_group_T, k_group_E,
                    extra_block=extra_block, tree=tree)
