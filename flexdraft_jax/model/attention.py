"""The one attention primitive every layout in FlexDraft reduces to.

Keys come from two places:
  * the KV cache `k_BxSxKxD`, indexed by *position*: query row t of sequence b
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

from typing import Optional

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def attend_xla(q_BxTxNxD, k_BxSxKxD, v_BxSxKxD, limit_BxT,
               xk_BxExKxD=None, xv_BxExKxD=None,
               q_group_T=None, k_group_E=None):
  """Reference attention (fp32 softmax); GQA without repeating K/V.

  Returns `[B, T, N, D]` in q's dtype. A row that sees no key returns zeros.
  """
  B, T, N, D = q_BxTxNxD.shape
  K = k_BxSxKxD.shape[2]
  G = N // K
  q = q_BxTxNxD.reshape(B, T, K, G, D).astype(jnp.float32) * (D ** -0.5)
  s_BxKxGxTxS = jnp.einsum("BTKGD,BSKD->BKGTS", q,
                           k_BxSxKxD.astype(jnp.float32))
  S = k_BxSxKxD.shape[1]
  visible_BxTxS = jnp.arange(S)[None, None, :] <= limit_BxT[:, :, None]
  s_BxKxGxTxS = jnp.where(visible_BxTxS[:, None, None], s_BxKxGxTxS, NEG_INF)
  scores = [s_BxKxGxTxS]
  values = [v_BxSxKxD]
  if xk_BxExKxD is not None and xk_BxExKxD.shape[1] > 0:
    x_BxKxGxTxE = jnp.einsum("BTKGD,BEKD->BKGTE", q,
                             xk_BxExKxD.astype(jnp.float32))
    same_TxE = ((q_group_T[:, None] >= 0)
                & (q_group_T[:, None] == k_group_E[None, :]))
    scores.append(jnp.where(same_TxE[None, None, None], x_BxKxGxTxE, NEG_INF))
    values.append(xv_BxExKxD)
  s = jnp.concatenate(scores, axis=-1)
  v = jnp.concatenate(values, axis=1).astype(jnp.float32)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - m)
  p = jnp.where(s > NEG_INF / 2, p, 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  o_BxKxGxTxD = jnp.einsum("BKGTS,BSKD->BKGTD", p, v)
  o = jnp.transpose(o_BxKxGxTxD, (0, 3, 1, 2, 4)).reshape(B, T, N, D)
  return o.astype(q_BxTxNxD.dtype)


def resolve_impl(impl: str) -> str:
  if impl == "auto":
    return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"
  if impl not in ("xla", "pallas"):
    raise ValueError(f"attention_impl must be xla, pallas or auto, got {impl!r}")
  return impl


def attend(q_BxTxNxD, k_BxSxKxD, v_BxSxKxD, limit_BxT,
           xk_BxExKxD=None, xv_BxExKxD=None,
           q_group_T: Optional[jax.Array] = None,
           k_group_E: Optional[jax.Array] = None, *, impl: str = "xla"):
  """Attention under the position-limit + group layout (see module doc)."""
  if resolve_impl(impl) == "pallas":
    from flexdraft_jax.kernels import attention as pallas_attention
    return pallas_attention.attend_pallas(
        q_BxTxNxD, k_BxSxKxD, v_BxSxKxD, limit_BxT,
        xk_BxExKxD, xv_BxExKxD, q_group_T, k_group_E)
  return attend_xla(q_BxTxNxD, k_BxSxKxD, v_BxSxKxD, limit_BxT,
                    xk_BxExKxD, xv_BxExKxD, q_group_T, k_group_E)
