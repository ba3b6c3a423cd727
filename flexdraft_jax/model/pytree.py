"""The pytrees the decoder reads: the target and draft weights in either layout,
the KV cache and the mask rows, and the helpers that read either layout.

The *target pytree* (frozen; weights `[in, out]`, layers stacked on axis 0):

  {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (untied only),
   "layers": {"input_norm": [n, H], "post_norm": [n, H],
              "q": [n, H, N*D], "k": [n, H, K*D], "v": [n, H, K*D], "o": [n, N*D, H],
              "q_bias"/"k_bias"/"v_bias": [n, ...] (attention_bias only),
              "q_norm"/"k_norm": [n, D] (qk_norm only),
              "gate": [n, H, F], "up": [n, H, F], "down": [n, F, H]}}

The per-layer (decoding) layout, `layers` a list of n dicts, holds the matmul
weights transposed, `[out, in]`, as KEY + "_t" (`decode_layer`,
`transformer.linear`); `layer_leaf` reads either layout as above.

The *draft pytree* (trainable, flexdraft_jax/drafter) holds `mask` [H], the
draft attention projectors of the last L layers stacked as `layers` [L, ...]
(same keys as above, attention ones only) and the calibration MLP.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from flexdraft_jax.model.config import ModelConfig

ATTN_KEYS = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm")
# The matmul weights, `[in, out]`; the per-layer (decoding) layout holds them
# transposed, `[out, in]`, as KEY + "_t" (see `decode_layer`).
MATMUL_KEYS = ("q", "k", "v", "o", "gate", "up", "down")


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
  see; group_M: its group id (rows of one group attend to each other);
  bonus_BxM: the bonus token of each row's group, for a drafter that reads it
  at slot 0 (`bonus_in`); None, or -1 for a group, drafts blind (slot 0 is
  the mask alone: parallel mode, where the bonus is not known yet); block: a
  static int when the groups are contiguous runs of that many rows (training's anchor blocks), so a
  mask-only pass scores each row against its own block's keys only.
  """
  pos_BxM: jax.Array
  limit_BxM: jax.Array
  group_M: jax.Array
  bonus_BxM: Optional[jax.Array] = None
  block: Optional[int] = None


class TreeRows(NamedTuple):
  """Clean rows that are a draft tree's nodes (tree verification).

  slot_BxT: the cache slot each row writes its K/V to, consecutive from the
  root's (`slot[:, 0]`, the bonus's position): node t at slot root + t, its
  RoPE position the root's plus its depth. anc_BxTxT: bool, row t sees row u
  iff u is t or an ancestor of t (nodes come in topological order: u <= t).
  """
  slot_BxT: jax.Array
  anc_BxTxT: jax.Array


def layer_shapes(cfg: ModelConfig) -> dict:
  """Expected per-layer shape of every stacked key for `cfg`."""
  H, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  shapes = {"input_norm": (H,), "post_norm": (H,),
            "q": (H, cfg.q_size), "k": (H, cfg.kv_size), "v": (H, cfg.kv_size),
            "o": (cfg.q_size, H), "gate": (H, F), "up": (H, F), "down": (F, H)}
  if cfg.attention_bias:
    shapes.update(q_bias=(cfg.q_size,), k_bias=(cfg.kv_size,), v_bias=(cfg.kv_size,))
  if cfg.qk_norm:
    shapes.update(q_norm=(D,), k_norm=(D,))
  return shapes


def global_shapes(cfg: ModelConfig) -> dict:
  """Expected shape of every non-layer key for `cfg`."""
  shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "final_norm": (cfg.hidden_size,)}
  if not cfg.tie_embeddings:
    shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
  return shapes


def layer_at(layers, i):
  """Layer i's weights from a per-layer list or a stacked dict (a traced i needs
  the stacked one)."""
  if isinstance(layers, (list, tuple)):
    return layers[i]
  return jax.tree.map(lambda w: w[i], layers)


def deep_layers_view(params, num_draft_layers: int) -> dict:
  """`params` with per-layer weights for the last `num_draft_layers` layers
  only (the shallow ones None): all a mask-only pass reads. A trainer makes
  it once; slicing stacked weights inside each step copies them every step."""
  layers = params["layers"]
  n = len(layers) if is_per_layer(params) else jax.tree.leaves(layers)[0].shape[0]
  s = n - num_draft_layers
  return dict(params, layers=[None] * s + [layer_at(layers, i) for i in range(s, n)])


def is_per_layer(params) -> bool:
  """Whether `params["layers"]` is a list of per-layer dicts (decoding layout)."""
  return isinstance(params["layers"], (list, tuple))


def layer_leaf(params, key: str, i: int):
  """Layer i's weight `key` as `[in, out]`, in either layout (i may be negative)."""
  layers = params["layers"]
  if not is_per_layer(params):
    return layers[key][i]
  lp = layers[i]
  return lp[key] if key in lp else lp[key + "_t"].T


def layer_keys(params) -> list:
  """The per-layer weight names (as `layer_leaf` takes them), in either layout."""
  layers = params["layers"]
  return [k.removesuffix("_t") if k.removesuffix("_t") in MATMUL_KEYS else k
          for k in (layers[0] if is_per_layer(params) else layers)]


def decode_layer(layer: dict, keys=MATMUL_KEYS) -> dict:
  """One layer's weights as the per-layer layout holds them: the matmul
  weights (`keys`) transposed to `[out, in]` under KEY + "_t" (see
  `transformer.linear`), the rest as they are; each transposed weight is a
  contiguous copy."""
  return {(k + "_t" if k in keys else k): (jnp.swapaxes(w, 0, 1) if k in keys else w)
          for k, w in layer.items()}


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
  return dict(params, layers=[decode_layer({k: v[i] for k, v in stacked.items()})
                              for i in range(n)])
