"""Functional decoder for Llama / Qwen2 / Qwen3, with FlexDraft's dual-path deep layers.

The target and draft pytrees, their two layouts and the cache and mask-row
containers are in model/pytree.py.

`Transformer` is the target as a Flax linen module: it owns the target pytree
as its "params" collection (`init` creates it, the loaders fill it) and reads
the draft pytree, when mask rows run, from the "draft" collection (declared by
`drafter.model.DraftModel`). Its `forward` runs clean tokens through every
layer and, optionally, mask rows through the deep layers `[s, n)`. Clean rows
use only target weights and so compute exactly what the target alone computes
(SPEC §1). The functions `forward`, `embed`, `logits`, ... apply the module to
plain pytrees.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from flexdraft_jax.kernels import cpu_matmul
from flexdraft_jax.model import attention
from flexdraft_jax.model.config import ModelConfig
from flexdraft_jax.model.pytree import (
    KVCache, MaskRows, TreeRows, decode_layer, global_shapes, layer_at, layer_shapes)


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


def linear(p, key: str, x_BxTxI):
  """`x @ W` for weight `key` of the dict `p`: stored `[in, out]` as `key`, or
  `[out, in]` as `key_t` (`pytree.decode_layer`; then through `matmul_t`)."""
  w_t = p.get(key + "_t")
  if w_t is None:
    return jnp.einsum("BTI,IO->BTO", x_BxTxI, p[key])
  return matmul_t(w_t, x_BxTxI)


def matmul_t(w_OxI, x_BxTxI, preferred_element_type=None):
  """`x @ w.T` `[B, T, O]` for a weight stored `[out, in]`, computed as
  `w @ x.T`, an `[O, I] x [I, B*T]` product: XLA:CPU runs it 1.1-1.5x faster
  than `x @ W` for the 1-16 rows of an AR step, a verify block or a mask block
  (both operands row-major, the long dimension outermost). The barriers keep
  XLA from folding the transposes back into the dot, which would undo it.
  Above 4 rows the product runs on a multiple of 8 (zero rows added, then
  dropped): 5-7 rows took longer than 8 on the 2-core CPU.

  On a CPU with fp32 weights it runs `kernels.cpu_matmul` instead (up to 8
  rows for the price of one, identical rows whatever their number)."""
  B, T, I = x_BxTxI.shape
  N = B * T
  x_NxI = x_BxTxI.reshape(N, I)
  if cpu_matmul.supports(w_OxI, x_NxI) and preferred_element_type in (None, jnp.float32):
    return cpu_matmul.matmul_t(w_OxI, x_NxI).reshape(B, T, w_OxI.shape[0])
  return xla_matmul_t(w_OxI, x_NxI, preferred_element_type).reshape(B, T, w_OxI.shape[0])


def xla_matmul_t(w_OxI, x_NxI, preferred_element_type=None):
  """`x @ w.T` `[N, O]` through XLA's dot, as `matmul_t` runs it without the
  CPU kernel."""
  N = x_NxI.shape[0]
  pad = -N % 8 if N > 4 else 0
  if pad:
    x_NxI = jnp.pad(x_NxI, ((0, pad), (0, 0)))
  x_IxN = jax.lax.optimization_barrier(x_NxI.T)
  y_OxN = jax.lax.optimization_barrier(jnp.einsum(
      "OI,IN->ON", w_OxI, x_IxN, preferred_element_type=preferred_element_type))
  return y_OxN[:, :N].T


def _project_qkv(ap, x_BxTxH, pos_BxT, cfg: ModelConfig):
  """Queries `[B, T, N, D]`, RoPE'd keys and values `[B, T, K, D]`."""
  N, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  q_BxTxND = linear(ap, "q", x_BxTxH)
  k_BxTxKD = linear(ap, "k", x_BxTxH)
  v_BxTxKD = linear(ap, "v", x_BxTxH)
  if cfg.attention_bias:
    q_BxTxND = q_BxTxND + ap["q_bias"]
    k_BxTxKD = k_BxTxKD + ap["k_bias"]
    v_BxTxKD = v_BxTxKD + ap["v_bias"]
  B, T = pos_BxT.shape
  q = q_BxTxND.reshape(B, T, N, D)
  k = k_BxTxKD.reshape(B, T, K, D)
  v = v_BxTxKD.reshape(B, T, K, D)
  if cfg.qk_norm:
    q = rms_norm(q, ap["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, ap["k_norm"], cfg.rms_norm_eps)
  return rope(q, pos_BxT, cfg), rope(k, pos_BxT, cfg), v


def _mlp(lp, x_BxTxH):
  """SwiGLU feed-forward."""
  gate_BxTxF = jax.nn.silu(linear(lp, "gate", x_BxTxH))
  up_BxTxF = linear(lp, "up", x_BxTxH)
  return linear(lp, "down", gate_BxTxF * up_BxTxF)


def _write(cache, i, pos_BxT, new_BxTxKxD):
  """Writes rows at their positions in layer i of a stacked `[n, B, K, S, D]`
  cache (or in a per-layer `[B, K, S, D]` one when i is None); positions past
  the end are dropped."""
  b_BxT = jnp.broadcast_to(jnp.arange(pos_BxT.shape[0])[:, None], pos_BxT.shape)
  # Advanced indices (b, ·, pos) are split by a slice, so the update is laid
  # out [B, T, K, D] — exactly new_BxTxKxD.
  idx = (b_BxT, slice(None), pos_BxT) if i is None else (i, b_BxT, slice(None), pos_BxT)
  return cache.at[idx].set(new_BxTxKxD.astype(cache.dtype), mode="drop")


def _residual(lp, ap, h_BxTxH, o_BxTxND, eps):
  """Attention output projection (`ap["o"]`), residual, then the (frozen) MLP
  block (`lp`)."""
  h = h_BxTxH + linear(ap, "o", o_BxTxND)
  return h + _mlp(lp, rms_norm(h, lp["post_norm"], eps))


def _layer_step(*, cfg, lp, dp, h_BxTxH, hm_BxMxH, ck, cv, layer, pos_BxT, masks,
                attn_impl, kv_block, mp=None, tree=None):
  """One decoder layer on clean rows (T may be 0) and mask rows (`hm_BxMxH`
  None: none). Clean rows write their K/V into the cache (stacked caches at
  index `layer`; per-layer ones when `layer` is None); mask rows read the
  cache and their own group's K/V but write nothing. `lp` are the target's
  weights, `dp` the draft projectors (mask rows only), `mp` the MLP weights
  mask rows use instead of `lp`'s (a narrower copy, see `forward`).
  `tree` (a `pytree.TreeRows`): the clean rows are a draft tree's nodes, written
  to `tree.slot_BxT` rather than their positions and seeing their ancestors.
  Returns (h_BxTxH, hm_BxMxH or None, ck, cv)."""
  eps = cfg.rms_norm_eps
  T = h_BxTxH.shape[1]
  with_masks = hm_BxMxH is not None
  q_rows, limits, groups = [], [], []
  if T:
    q, k, v = _project_qkv(lp, rms_norm(h_BxTxH, lp["input_norm"], eps), pos_BxT, cfg)
    slot_BxT = pos_BxT if tree is None else tree.slot_BxT
    ck, cv = _write(ck, layer, slot_BxT, k), _write(cv, layer, slot_BxT, v)
    q_rows.append(q)
    limits.append(slot_BxT)
    groups.append(jnp.full((T,), -1, jnp.int32))
  mask_k = mask_v = None
  if with_masks:
    qm, mask_k, mask_v = _project_qkv(dp, rms_norm(hm_BxMxH, lp["input_norm"], eps),
                                      masks.pos_BxM, cfg)
    q_rows.append(qm)
    limits.append(masks.limit_BxM)
    groups.append(masks.group_M.astype(jnp.int32))
  o_BxRxNxD = attention.attend(
      jnp.concatenate(q_rows, axis=1), ck if layer is None else ck[layer],
      cv if layer is None else cv[layer], jnp.concatenate(limits, axis=1),
      mask_k, mask_v, jnp.concatenate(groups), masks.group_M if with_masks else None,
      impl=attn_impl, kv_block=kv_block,
      extra_block=masks.block if with_masks and not T else None,
      tree=None if tree is None else (tree.slot_BxT[:, 0], tree.anc_BxTxT))
  o_BxRxND = o_BxRxNxD.reshape(o_BxRxNxD.shape[:2] + (-1,))
  if T:
    h_BxTxH = _residual(lp, lp, h_BxTxH, o_BxRxND[:, :T], eps)
  if with_masks:
    hm_BxMxH = _residual(lp if mp is None else mp, dp, hm_BxMxH, o_BxRxND[:, T:], eps)
  return h_BxTxH, hm_BxMxH, ck, cv


def _init(key: str):
  """A weight's initializer: norms start at one, biases at zero, the rest
  N(0, 0.02²)."""
  if key.endswith("norm"):
    return nn.initializers.ones
  if key.endswith("_bias"):
    return nn.initializers.zeros
  return nn.initializers.normal(0.02)


class Transformer(nn.Module):
  """The target decoder as a linen module over the collections "params" (the
  target pytree, which it declares) and "draft" (the draft pytree, read by
  mask rows only; see `drafter.model.DraftModel`).

  `layout` is that of `params["layers"]`: "stacked" (`[n, ...]` leaves) or
  "layers" (a list of per-layer dicts; `transposed`: the matmul weights
  `[out, in]` as KEY + "_t"; layers below `first_layer` None, a
  `pytree.deep_layers_view`). `Transformer.of(cfg, params)` reads it off a tree.
  """
  cfg: ModelConfig
  layout: str = "stacked"
  first_layer: int = 0
  transposed: bool = True
  dtype: Any = jnp.float32  # of the weights `init` creates

  @classmethod
  def of(cls, cfg: ModelConfig, params) -> "Transformer":
    """The module whose "params" collection `params` is."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
      return cls(cfg)
    first = next(i for i, lp in enumerate(layers) if lp is not None)
    return cls(cfg, "layers", first, any(k.endswith("_t") for k in layers[first]))

  def setup(self):
    cfg = self.cfg
    shapes = global_shapes(cfg)
    self.embedding = self.param("embed", _init("embed"), shapes["embed"], self.dtype)
    self.final_norm = self.param("final_norm", _init("final_norm"), shapes["final_norm"],
                                 self.dtype)
    self.lm_head = (None if cfg.tie_embeddings else
                    self.param("lm_head", _init("lm_head"), shapes["lm_head"], self.dtype))
    self.layers = self.param("layers", self._init_layers)

  def _init_layers(self, rng):
    n, shapes = self.cfg.num_layers, layer_shapes(self.cfg)
    keys = jax.random.split(rng, len(shapes))
    stacked = {k: _init(k)(r, (n,) + shape, self.dtype)
               for r, (k, shape) in zip(keys, shapes.items())}
    if self.layout == "stacked":
      return stacked
    per_layer = [{k: w[i] for k, w in stacked.items()} for i in range(n)]
    if self.transposed:
      per_layer = [decode_layer(lp) for lp in per_layer]
    return [None] * self.first_layer + per_layer[self.first_layer:]

  def weights(self) -> dict:
    """The target pytree: `init(rng, method="weights")` creates a random one."""
    return self.variables["params"]

  def __call__(self, tokens_BxT):
    """fp32 logits `[B, T, V]` of whole sequences (positions 0..T-1)."""
    B, T = tokens_BxT.shape
    cache = KVCache.zeros(self.cfg, B, T, self.embedding.dtype,
                          per_layer=self.layout == "layers")
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, _, _ = self.forward(cache, tokens_BxT, pos)
    return self.logits(h)

  def embed(self, tokens_BxT):
    return jnp.take(self.embedding, tokens_BxT, axis=0)

  def logits(self, h_BxTxH):
    """Final norm + LM head, fp32 logits `[B, T, V]`."""
    x = rms_norm(h_BxTxH, self.final_norm, self.cfg.rms_norm_eps)
    if self.cfg.tie_embeddings:
      return jnp.einsum("BTH,VH->BTV", x, self.embedding,
                        preferred_element_type=jnp.float32)
    return jnp.einsum("BTH,HV->BTV", x, self.lm_head,
                      preferred_element_type=jnp.float32)

  def greedy_tokens(self, h_BxTxH):
    """`argmax(logits(h))` `[B, T]` int32, without materialising `[B, T, V]`
    row-major: the head is computed as `[V, B*T]` (vocabulary rows streamed
    once), which XLA:CPU runs ~1.5x faster than the `[B*T, V]` product for
    2-32 rows (the verify block at small batch) and no slower for one row or
    many. Decoding uses it for every greedy token, so AR steps and verify
    blocks take their argmax from the same computation (on a CPU, the tied head
    through `kernels.cpu_matmul`, whose rows do not depend on B * T)."""
    cfg = self.cfg
    B, T, H = h_BxTxH.shape
    x = rms_norm(h_BxTxH, self.final_norm, cfg.rms_norm_eps).reshape(B * T, H)
    if cfg.tie_embeddings and cpu_matmul.supports(self.embedding, x):
      lg = cpu_matmul.matmul_t(self.embedding, x)
      return jnp.argmax(lg, axis=-1).astype(jnp.int32).reshape(B, T)
    if cfg.tie_embeddings:
      lg = jnp.einsum("VH,NH->VN", self.embedding, x, preferred_element_type=jnp.float32)
    else:
      lg = jnp.einsum("HV,NH->VN", self.lm_head, x, preferred_element_type=jnp.float32)
    return jnp.argmax(lg, axis=0).astype(jnp.int32).reshape(B, T)

  def draft(self) -> dict:
    """The draft pytree (the "draft" collection)."""
    return self.variables["draft"]

  def mask_input(self, masks: MaskRows, dtype):
    """Mask rows' hidden states at the split layer: the learned mask vector `[H]`,
    or per-slot vectors `[bs, H]`: row m gets the vector of its slot, its index
    within its group (groups are contiguous runs of `group_M`, in order). A
    drafter with `bonus_in` adds `embed(bonus) @ bonus_in` at slot 0 where the
    bonus is known (>= 0)."""
    draft = self.draft()
    B, M = masks.pos_BxM.shape
    group = masks.group_M.astype(jnp.int32)
    slot = jnp.arange(M) - jnp.searchsorted(group, group, side="left")
    mask = draft["mask"].astype(dtype)
    if mask.ndim == 2:
      mask = mask[jnp.minimum(slot, mask.shape[0] - 1)]
    hm = jnp.broadcast_to(mask, (B, M, mask.shape[-1]))
    if "bonus_in" not in draft or masks.bonus_BxM is None:
      return hm
    known = (slot == 0)[None, :] & (masks.bonus_BxM >= 0)
    e = (self.embed(jnp.maximum(masks.bonus_BxM, 0)).astype(dtype)
         @ draft["bonus_in"].astype(dtype))
    return hm + jnp.where(known[..., None], e, 0).astype(dtype)

  def forward(self, cache: KVCache, tokens_BxT: Optional[jax.Array],
              pos_BxT: Optional[jax.Array], *, masks: Optional[MaskRows] = None,
              num_draft_layers: int = 0, attn_impl: str = "xla",
              kv_block: Optional[int] = None, tree: Optional[TreeRows] = None):
    """Runs clean tokens (all layers) and mask rows (deep layers) in one pass.

    Args:
      tokens_BxT/pos_BxT: clean tokens and their positions; `None` for a
        deep-layers-only pass of mask rows (sequential drafting, training).
      masks/num_draft_layers: the mask rows and L; mask rows enter at layer
        `n - L` as the learned `mask` vector, through the draft collection's
        attention. A decoding draft pytree may hold `deep_mlp`, per deep layer
        the MLP weights (gate/up/down `_t`, post_norm) the mask rows use in
        place of the target's: a bf16 copy, so the draft pass streams half the
        bytes (`drafter.model.narrow_draft_params`; clean rows keep the target's).
      kv_block: read the cache in blocks up to the largest visible position
        (decoding; not differentiable); None reads it whole (training).
      tree: the clean rows are a draft tree (`pytree.TreeRows`): `pos_BxT` are
        their RoPE positions (the bonus's plus their depth), their K/V go to
        slots `tree.slot_BxT` (consecutive), and each row sees the cache
        before them and its ancestors in the tree (no mask rows).
    Returns:
      (h_clean [B, T, H] or None, h_mask [B, M, H] or None, cache) — hidden
      states before the final norm; the cache holds the clean K/V written.

    Stacked weights (`[n, ...]` leaves) run as two `lax.scan`s (shallow
    layers, deep layers); per-layer weights (`pytree.unstack_layers`) as a Python
    loop: XLA:CPU copies each layer's slice out of stacked weights before its
    matmuls, which doubles the bytes a decode step moves, while separate
    arrays are read in place.
    """
    cfg = self.cfg
    n = cfg.num_layers
    s = n - num_draft_layers if masks is not None else n
    clean = tokens_BxT is not None
    if clean:
      h = self.embed(tokens_BxT)
    else:  # a mask-only pass gets T = 0
      B = masks.pos_BxM.shape[0]
      h = jnp.zeros((B, 0, cfg.hidden_size), self.embedding.dtype)
      pos_BxT = jnp.zeros((B, 0), jnp.int32)
    if tree is not None and masks is not None:
      raise ValueError("a draft tree's rows run without mask rows")
    step = functools.partial(_layer_step, cfg=cfg, pos_BxT=pos_BxT, masks=masks,
                             attn_impl=attn_impl, kv_block=kv_block, tree=tree)
    if self.layout == "layers":
      return self._layer_loop(self.layers, cache, h, s, masks, step, clean)

    layers = self.layers
    ck, cv = cache

    def shallow(carry, i):
      h, ck, cv = carry
      h, _, ck, cv = step(lp=layer_at(layers, i), dp=None, h_BxTxH=h, hm_BxMxH=None,
                          ck=ck, cv=cv, layer=i)
      return (h, ck, cv), None

    if clean and s > 0:
      (h, ck, cv), _ = jax.lax.scan(shallow, (h, ck, cv), jnp.arange(s))
    if masks is None:
      return h, None, KVCache(ck, cv)

    # A mask-only pass may get the cache of the deep layers alone (training).
    offset = n - ck.shape[0]
    if offset and (clean or offset > s):
      raise ValueError(f"a cache of {ck.shape[0]} layers serves only a mask-only pass "
                       f"over the last {n - s} layers")
    if not clean:
      # Training's mask-only pass runs the few deep layers as the per-layer
      # loop: under a gradient a scan stacks each layer's residuals (its cache
      # slice, attention weights) into fresh [L, ...] buffers every step.
      per_layer = lambda c: tuple([None] * s + [c[i - offset] for i in range(s, n)])
      deep = [None] * s + [layer_at(layers, i) for i in range(s, n)]
      return self._layer_loop(deep, KVCache(per_layer(ck), per_layer(cv)), h, s, masks,
                              step, clean)

    draft_layers = self.draft()["layers"]

    def deep(carry, i):
      h, hm, ck, cv = carry
      h, hm, ck, cv = step(lp=layer_at(layers, i), dp=layer_at(draft_layers, i - s),
                           h_BxTxH=h, hm_BxMxH=hm, ck=ck, cv=cv, layer=i - offset)
      return (h, hm, ck, cv), None

    hm = self.mask_input(masks, h.dtype)
    (h, hm, ck, cv), _ = jax.lax.scan(deep, (h, hm, ck, cv), jnp.arange(s, n))
    return h, hm, KVCache(ck, cv)

  def _layer_loop(self, layers, cache, h, s, masks, step, clean):
    """`forward` over per-layer weights (`layers`, a list of n dicts, None
    below the first layer run) and a per-layer cache, as a Python loop."""
    ck, cv = list(cache.k), list(cache.v)
    draft = self.draft() if masks is not None else None
    hm = None
    for i in range(0 if clean else s, self.cfg.num_layers):
      if i == s and masks is not None:
        hm = self.mask_input(masks, h.dtype)
      dp = layer_at(draft["layers"], i - s) if hm is not None else None
      mp = draft["deep_mlp"][i - s] if hm is not None and "deep_mlp" in draft else None
      h, hm, ck[i], cv[i] = step(lp=layers[i], dp=dp, mp=mp, h_BxTxH=h, hm_BxMxH=hm,
                                 ck=ck[i], cv=cv[i], layer=None)
    return (h if clean else None), hm, KVCache(tuple(ck), tuple(cv))


def variables(params, draft=None) -> dict:
  """The modules' variables: the target pytree as "params", the draft pytree
  (when given) as "draft"."""
  return {"params": params} if draft is None else {"params": params, "draft": draft}


def forward(params, cfg: ModelConfig, cache: KVCache,
            tokens_BxT: Optional[jax.Array], pos_BxT: Optional[jax.Array], *,
            draft=None, **kw):
  """`Transformer.forward` over the target pytree `params` and the draft
  pytree `draft` (see there for the arguments)."""
  return Transformer.of(cfg, params).apply(variables(params, draft), cache, tokens_BxT,
                                           pos_BxT, method="forward", **kw)


def mask_input(params, cfg: ModelConfig, draft, masks: MaskRows, dtype):
  """`Transformer.mask_input` over the target and draft pytrees."""
  return Transformer.of(cfg, params).apply(variables(params, draft), masks, dtype,
                                           method="mask_input")


def logits(params, cfg: ModelConfig, h_BxTxH):
  """`Transformer.logits` over the target pytree `params`."""
  return Transformer.of(cfg, params).apply(variables(params), h_BxTxH, method="logits")


def greedy_tokens(params, cfg: ModelConfig, h_BxTxH):
  """`Transformer.greedy_tokens` over the target pytree `params`."""
  return Transformer.of(cfg, params).apply(variables(params), h_BxTxH,
                                           method="greedy_tokens")
