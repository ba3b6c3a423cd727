"""The weights as decoding reads them, made once and cached: per-layer copies of
stacked pytrees (each layer's weights read in place), a drafter's decoding
pytree (its draft head gathered, its calibration MLP transposed) and its
narrowed copy (the draft pass in bf16, `resolve_draft_dtype`). The caches keep
the few most recent trees, so a long-lived process holds only what it decodes
with now."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp

from flexdraft_jax.drafter.model import draft_head, narrow_draft_params
from flexdraft_jax.kernels import cpu_matmul
from flexdraft_jax.model import pytree


# id(tree) -> (tree, per-layer copy); the few most recent trees (a target and
# its drafters), so a long-lived process doesn't keep every tree it decoded.
_unstacked = collections.OrderedDict()
_UNSTACKED_MAX = 4


def resolve_draft_dtype(draft_dtype: str, target_params):
  """The dtype the draft pass reads its matmul weights in, or None for the
  weights' own. "auto": bf16 where the CPU kernel runs and the target is fp32
  (SmolLM2-135M's L = 8 draft pass at batch 1 on the 2-core CPU: 8.7 -> 6.0
  ms); elsewhere the weights' own dtype."""
  if draft_dtype == "bfloat16":
    return jnp.bfloat16
  if draft_dtype == "target":
    return None
  fp32 = target_params["embed"].dtype == jnp.float32
  return jnp.bfloat16 if fp32 and cpu_matmul.available() else None


# (trees, dtype) -> decoding draft pytree, the most recent few
_narrowed = collections.OrderedDict()


def draft_decoding_params(target_params, cfg, draft_params, dtype=None):
  """The draft pytree for decoding: per-layer (matmul weights `[out, in]`, see
  `pytree.decode_layer`), the calibration's too, and with a draft
  vocabulary its draft head (those rows of the LM head) gathered once here,
  not every step. With `dtype` the draft pass reads its weights narrowed
  (`narrow_draft_params`). Cached per (target, drafter, dtype)."""
  name = None if dtype is None else jnp.dtype(dtype).name
  return _cached(_narrowed, (id(target_params), id(draft_params), name),
                 (target_params, draft_params),
                 lambda: _draft_pytree(target_params, draft_params, cfg=cfg, dtype=name))


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _draft_pytree(target_params, draft_params, *, cfg, dtype):
  """`draft_decoding_params`'s tree, made in one program (as separate eager
  operations, one small program each, it took 0.2 s for SmolLM2-135M's)."""
  params = draft_params if pytree.is_per_layer(draft_params) else _draft_layout(draft_params)
  if "vocab" in params:
    params = dict(params, head=draft_head(target_params, cfg, params))
  return params if dtype is None else narrow_draft_params(target_params, cfg, params,
                                                          jnp.dtype(dtype))


def _draft_layout(draft_params):
  """A draft pytree per-layer, its calibration MLP's weights transposed too."""
  params = pytree.unstack_layers(draft_params)
  if "calib" not in params:
    return params
  return dict(params, calib=pytree.decode_layer(params["calib"], keys=("w1", "w2")))


def decoding_params(tree, convert=pytree.unstack_layers):
  """`tree` with per-layer weight arrays: decoding reads each layer's weights in
  place instead of slicing a stacked array. A tree already in that layout
  (`load_target(..., layout="layers")`) is used as is; a stacked one gets a
  per-layer copy (`convert`), cached per pytree object."""
  if pytree.is_per_layer(tree):
    return tree
  return _cached(_unstacked, id(tree), (tree,), lambda: convert(tree))


def _cached(cache, key, trees: tuple, make):
  """`make()`, cached in `cache` under `key` while `trees` (what it was made
  from, matched by identity) live; the `_UNSTACKED_MAX` most recent entries."""
  hit = cache.get(key)
  if hit is None or any(a is not b for a, b in zip(hit[0], trees)):
    hit = (trees, make())
    cache[key] = hit
  cache.move_to_end(key)
  while len(cache) > _UNSTACKED_MAX:
    cache.popitem(last=False)
  return hit[1]
