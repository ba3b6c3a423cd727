"""Functional decoder for Llama / Qwen2 / Qwen3, with FlexDraft's dual-path deep layers.

The *target pytree* (frozen; weights `[in, out]`, layers stacked on axis 0):

  {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (untied only),
   "layers": {"input_norm": [n, H], "post_norm": [n, H],
              "q": [n, H, N*D], "k": [n, H, K*D], "v": [n, H, K*D], "o": [n, N*D, H],
              "q_bias"/"k_bias"/"v_bias": [n, ...] (attention_bias only),
              "q_norm"/"k_norm": [n, D] (qk_norm only),
              "gate": [n, H, F], "up": [n, H, F], "down": [n, F, H]}}

The *draft pytree* (trainable, flexdraft_jax/drafter) holds `mask` [H], the
draft attention projectors of the last L layers stacked as `layers` [L, ...]
(same keys as above, attention ones only) and the calibration MLP.

`forward` runs clean tokens through every layer and, optionally, mask rows
through the deep layers `[s, n)`. Clean rows use only target weights and so
compute exactly what the target alone computes (SPEC §1).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from flexdraft_jax.model import attention
from flexdraft_jax.model.config import ModelConfig

ATTN_KEYS = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm")


class KVCache(NamedTuple):
  """Per-layer K/V, `[n, B, K, S, D]` (or n arrays `[B, K, S, D]`); slot j
  holds position j of each row."""
  k: jax.Array
  v: jax.Array

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype, per_layer=False):
    """Stacked `[n, B, K, S, D]`, or a tuple of n `[B, K, S, D]` arrays."""
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    if per_layer:
      z = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
      return cls(z(), z())
    shape = (cfg.num_layers,) + shape
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class MaskRows(NamedTuple):
  """Mask-token rows joining at the split layer (SPEC §2).

  pos_BxM: RoPE position of each mask row; limit_BxM: last cache slot it may
  see; group_M: its group id (rows of one group attend to each other).
  """
  pos_BxM: jax.Array
  limit_BxM: jax.Array
  group_M: jax.Array


def mask_input(draft, masks: MaskRows, dtype):
  """Mask rows' hidden states at the split layer: the learned mask vector `[H]`,
  or per-slot vectors `[bs, H]`: row m gets the vector of its slot, its index
  within its group (groups are contiguous runs of `group_M`, in order)."""
  B, M = masks.pos_BxM.shape
  mask = draft["mask"].astype(dtype)
  if mask.ndim == 2:
    group = masks.group_M.astype(jnp.int32)
    slot = jnp.arange(M) - jnp.searchsorted(group, group, side="left")
    mask = mask[jnp.minimum(slot, mask.shape[0] - 1)]
  return jnp.broadcast_to(mask, (B, M, mask.shape[-1]))


def rms_norm(x, w, eps):
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * w.astype(jnp.float32)).astype(x.dtype)


def _inv_freq(cfg: ModelConfig):
  D = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
  if cfg.rope_scaling is None:
    return inv
  rs = dict(cfg.rope_scaling)
  if rs["rope_type"] == "linear":
    return inv / rs["factor"]
  # llama3: low frequencies divided by `factor`, high kept, smooth in between.
  factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
  old_len = rs["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv
  smooth = (old_len / wavelen - lo) / (hi - lo)
  scaled = jnp.where(wavelen > old_len / lo, inv / factor, inv)
  mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
  return jnp.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def rope(x_BxTxNxD, pos_BxT, cfg: ModelConfig):
  """Rotary embedding, HF "rotate_half" layout."""
  ang_BxTxF = pos_BxT[..., None].astype(jnp.float32) * _inv_freq(cfg)
  cos = jnp.cos(ang_BxTxF)[:, :, None, :]
  sin = jnp.sin(ang_BxTxF)[:, :, None, :]
  x = x_BxTxNxD.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxD.dtype)


def embed(params, tokens_BxT):
  return jnp.take(params["embed"], tokens_BxT, axis=0)


def logits(params, cfg: ModelConfig, h_BxTxH):
  """Final norm + LM head, fp32 logits `[B, T, V]`."""
  x = rms_norm(h_BxTxH, params["final_norm"], cfg.rms_norm_eps)
  if cfg.tie_embeddings:
    return jnp.einsum("BTH,VH->BTV", x, params["embed"],
                      preferred_element_type=jnp.float32)
  return jnp.einsum("BTH,HV->BTV", x, params["lm_head"],
                    preferred_element_type=jnp.float32)


def _layer(layers, i):
  """Layer i's weights from a per-layer list or a stacked dict (a traced i needs
  the stacked one)."""
  if isinstance(layers, (list, tuple)):
    return layers[i]
  return jax.tree.map(lambda w: w[i], layers)


def _project_qkv(ap, x_BxTxH, pos_BxT, cfg: ModelConfig):
  B, T, _ = x_BxTxH.shape
  q, k, v = (x_BxTxH @ ap["q"], x_BxTxH @ ap["k"], x_BxTxH @ ap["v"])
  if cfg.attention_bias:
    q, k, v = q + ap["q_bias"], k + ap["k_bias"], v + ap["v_bias"]
  q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
  k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
  v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
  if cfg.qk_norm:
    q = rms_norm(q, ap["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, ap["k_norm"], cfg.rms_norm_eps)
  return rope(q, pos_BxT, cfg), rope(k, pos_BxT, cfg), v


def _mlp(lp, x_BxTxH):
  return (jax.nn.silu(x_BxTxH @ lp["gate"]) * (x_BxTxH @ lp["up"])) @ lp["down"]


def _write(cache, i, pos_BxT, new_BxTxKxD):
  """Writes rows at their positions in layer i of a stacked `[n, B, K, S, D]`
  cache (or in a per-layer `[B, K, S, D]` one when i is None); positions past
  the end are dropped."""
  b_BxT = jnp.broadcast_to(jnp.arange(pos_BxT.shape[0])[:, None], pos_BxT.shape)
  # Advanced indices (b, ·, pos) are split by a slice, so the update is laid
  # out [B, T, K, D] — exactly new_BxTxKxD.
  idx = (b_BxT, slice(None), pos_BxT) if i is None else (i, b_BxT, slice(None), pos_BxT)
  return cache.at[idx].set(new_BxTxKxD.astype(cache.dtype), mode="drop")


def _layer_step(cfg, impl, kv_block, lp, dp, h_BxTxH, hm_BxMxH, ck, cv, i, pos_BxT, masks):
  """One decoder layer on clean rows (may be empty) and mask rows (may be None)."""
  eps = cfg.rms_norm_eps
  T = h_BxTxH.shape[1]
  qs, limits, groups = [], [], []
  if T:
    x = rms_norm(h_BxTxH, lp["input_norm"], eps)
    q, k, v = _project_qkv(lp, x, pos_BxT, cfg)
    ck = _write(ck, i, pos_BxT, k)
    cv = _write(cv, i, pos_BxT, v)
    qs.append(q)
    limits.append(pos_BxT)
    groups.append(jnp.full((T,), -1, jnp.int32))
  xk = xv = None
  if hm_BxMxH is not None:
    xm = rms_norm(hm_BxMxH, lp["input_norm"], eps)
    qm, xk, xv = _project_qkv(dp, xm, masks.pos_BxM, cfg)
    qs.append(qm)
    limits.append(masks.limit_BxM)
    groups.append(masks.group_M.astype(jnp.int32))
  q_group = jnp.concatenate(groups)
  o = attention.attend(
      jnp.concatenate(qs, axis=1), ck if i is None else ck[i],
      cv if i is None else cv[i], jnp.concatenate(limits, axis=1),
      xk, xv, q_group, None if hm_BxMxH is None else masks.group_M, impl=impl,
      kv_block=kv_block)
  o = o.reshape(o.shape[0], o.shape[1], -1)
  outs = []
  if T:
    h = h_BxTxH + o[:, :T] @ lp["o"]
    h = h + _mlp(lp, rms_norm(h, lp["post_norm"], eps))
    outs.append(h)
  else:
    outs.append(h_BxTxH)
  if hm_BxMxH is not None:
    hm = hm_BxMxH + o[:, T:] @ dp["o"]
    hm = hm + _mlp(lp, rms_norm(hm, lp["post_norm"], eps))
    outs.append(hm)
  else:
    outs.append(None)
  return outs[0], outs[1], ck, cv


def forward(params, cfg: ModelConfig, cache: KVCache,
            tokens_BxT: Optional[jax.Array], pos_BxT: Optional[jax.Array], *,
            draft=None, masks: Optional[MaskRows] = None,
            num_draft_layers: int = 0, attn_impl: str = "xla",
            kv_block: Optional[int] = None):
  """Runs clean tokens (all layers) and mask rows (deep layers) in one pass.

  Args:
    tokens_BxT/pos_BxT: clean tokens and their positions; `None` for a
      deep-layers-only pass of mask rows (sequential drafting, training).
    draft/masks/num_draft_layers: the draft pytree, the mask rows and L; mask
      rows enter at layer `n - L` as the learned `mask` vector.
    kv_block: read the cache in blocks up to the largest visible position
      (decoding; not differentiable); None reads it whole (training).
  Returns:
    (h_clean [B, T, H] or None, h_mask [B, M, H] or None, cache) — hidden
    states before the final norm; the cache holds the clean K/V written.
  """
  n = cfg.num_layers
  s = n - num_draft_layers if masks is not None else n
  layers = params["layers"]
  if isinstance(layers, (list, tuple)):
    return _forward_unrolled(params, cfg, cache, tokens_BxT, pos_BxT, draft, masks,
                             s, attn_impl, kv_block)
  ck, cv = cache
  if tokens_BxT is None:
    B = masks.pos_BxM.shape[0]
    h = jnp.zeros((B, 0, cfg.hidden_size), params["embed"].dtype)
    pos_BxT = jnp.zeros((B, 0), jnp.int32)
  else:
    h = embed(params, tokens_BxT)

  def shallow(carry, i):
    h, ck, cv = carry
    h, _, ck, cv = _layer_step(cfg, attn_impl, kv_block, _layer(layers, i), None, h, None,
                               ck, cv, i, pos_BxT, None)
    return (h, ck, cv), None

  if tokens_BxT is not None and s > 0:
    (h, ck, cv), _ = jax.lax.scan(shallow, (h, ck, cv), jnp.arange(s))
  if masks is None:
    return h, None, KVCache(ck, cv)

  hm = mask_input(draft, masks, h.dtype)

  # A mask-only pass may get the cache of the deep layers alone (training).
  offset = n - ck.shape[0]
  if offset and (tokens_BxT is not None or offset > s):
    raise ValueError(f"a cache of {ck.shape[0]} layers serves only a mask-only pass "
                     f"over the last {n - s} layers")

  def deep(carry, i):
    h, hm, ck, cv = carry
    h, hm, ck, cv = _layer_step(cfg, attn_impl, kv_block, _layer(layers, i),
                                _layer(draft["layers"], i - s), h, hm,
                                ck, cv, i - offset, pos_BxT, masks)
    return (h, hm, ck, cv), None

  (h, hm, ck, cv), _ = jax.lax.scan(deep, (h, hm, ck, cv), jnp.arange(s, n))
  return (h if tokens_BxT is not None else None), hm, KVCache(ck, cv)


def _forward_unrolled(params, cfg, cache, tokens_BxT, pos_BxT, draft, masks, s,
                      attn_impl, kv_block):
  """`forward` over per-layer weights and caches (see `unstack_layers`).

  A Python loop instead of a scan: XLA:CPU copies each layer's slice out of
  stacked weights before its matmuls, which doubles the bytes a decode step
  moves; separate arrays are read in place.
  """
  ck, cv = list(cache.k), list(cache.v)
  if tokens_BxT is None:
    B = masks.pos_BxM.shape[0]
    h = jnp.zeros((B, 0, cfg.hidden_size), params["embed"].dtype)
    pos_BxT = jnp.zeros((B, 0), jnp.int32)
    first = s
  else:
    h = embed(params, tokens_BxT)
    first = 0
  hm = None
  for i in range(first, cfg.num_layers):
    dp = None
    if i == s and masks is not None:
      hm = mask_input(draft, masks, h.dtype)
    if i >= s and masks is not None:
      dp = _layer(draft["layers"], i - s)
    h, hm, ck[i], cv[i] = _layer_step(cfg, attn_impl, kv_block, params["layers"][i], dp,
                                      h, hm, ck[i], cv[i], None, pos_BxT, masks)
  return (h if tokens_BxT is not None else None), hm, KVCache(tuple(ck), tuple(cv))


def is_per_layer(params) -> bool:
  """Whether `params["layers"]` is a list of per-layer dicts (decoding layout)."""
  return isinstance(params["layers"], (list, tuple))


def layer_leaf(params, key: str, i: int):
  """Layer i's weight `key`, in either layout (i may be negative)."""
  layers = params["layers"]
  return layers[i][key] if is_per_layer(params) else layers[key][i]


def layer_keys(params) -> list:
  """The per-layer weight names, in either layout."""
  layers = params["layers"]
  return list(layers[0] if is_per_layer(params) else layers)


def unstack_layers(params):
  """The same pytree with `layers` as a list of per-layer dicts (for decoding).

  Each layer's arrays are copies, so this holds the weights twice for as long
  as the stacked tree is referenced; `load_target(..., layout="layers")` loads
  the per-layer layout directly instead.
  """
  if is_per_layer(params):
    return params
  stacked = params["layers"]
  n = len(next(iter(stacked.values())))
  return dict(params, layers=[{k: v[i] for k, v in stacked.items()} for i in range(n)])
