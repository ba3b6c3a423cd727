"""Assembling the target pytree (see transformer.py) from per-tensor host arrays.

Checkpoint readers (hf.py, gguf_loader.py) supply host numpy arrays already in
the target layout (`[in, out]`); this module checks their shapes, stacks the
layers on axis 0 and moves them to the device in the requested dtype. It also
computes the target's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

import jax.numpy as jnp
import numpy as np

from flexdraft_jax.model import transformer
from flexdraft_jax.model.config import FlexDraftError, ModelConfig

# fetch_global(key) / fetch_layer(key, i) -> host array in target layout.
FetchGlobal = Callable[[str], np.ndarray]
FetchLayer = Callable[[str, int], np.ndarray]


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


def _checked(x: np.ndarray, want: tuple, what: str) -> np.ndarray:
  if tuple(x.shape) != tuple(want):
    raise FlexDraftError(f"tensor {what} has shape {tuple(x.shape)}, config implies {want}")
  return x


LAYOUTS = ("stacked", "layers")


def check_layout(layout: str) -> None:
  if layout not in LAYOUTS:
    raise FlexDraftError(f"layout must be 'stacked' or 'layers', got {layout!r}")


def build_params(cfg: ModelConfig, fetch_global: FetchGlobal, fetch_layer: FetchLayer,
                 dtype, layout: str = "stacked") -> dict:
  """The target pytree in either layout; one key at a time, so host memory holds
  at most one stacked tensor beyond the result.

  layout: "stacked" (`layers[key]` is `[n, ...]`; training scans over it) or
    "layers" (`layers[i][key]`, the matmul weights transposed as KEY + "_t":
    what decoding reads, without ever building the stacked copy; see
    `transformer.decode_layer`).
  """
  check_layout(layout)
  params = {k: jnp.asarray(_checked(fetch_global(k), shape, k), dtype=dtype)
            for k, shape in global_shapes(cfg).items()}
  if layout == "layers":
    params["layers"] = [transformer.decode_layer(
        {key: jnp.asarray(_checked(fetch_layer(key, i), shape, f"{key}[layer {i}]"),
                          dtype=dtype) for key, shape in layer_shapes(cfg).items()})
        for i in range(cfg.num_layers)]
    return params
  layers = {}
  for key, shape in layer_shapes(cfg).items():
    per_layer = [_checked(fetch_layer(key, i), shape, f"{key}[layer {i}]")
                 for i in range(cfg.num_layers)]
    layers[key] = jnp.asarray(np.stack(per_layer), dtype=dtype)
    del per_layer
  params["layers"] = layers
  return params


_FINGERPRINT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                       "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling",
                       "rms_norm_eps", "qk_norm", "attention_bias", "tie_embeddings")


def _fingerprint_slices(params) -> list:
  leaf = lambda k, i: transformer.layer_leaf(params, k, i)
  picks = [params["embed"][:8, :16], params["embed"][-8:, -16:],
           params["final_norm"][:16], leaf("input_norm", -1)[:16],
           leaf("q", 0)[:16, :16], leaf("k", -1)[-16:, -16:],
           leaf("down", -1)[:16, :16], leaf("gate", 0)[-16:, -16:]]
  if "lm_head" in params:
    picks.append(params["lm_head"][:16, :8])
  return picks


def fingerprint(cfg: ModelConfig, params) -> str:
  """16-hex digest of the architecture and a few weight slices.

  The slices are rounded to bf16 before hashing, so the digest is the same for
  a target loaded in float32 or bfloat16.
  """
  h = hashlib.sha256()
  fields = {f: getattr(cfg, f) for f in _FINGERPRINT_FIELDS}
  h.update(json.dumps(fields, sort_keys=True, default=str).encode())
  for x in _fingerprint_slices(params):
    x16 = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    h.update(np.ascontiguousarray(x16).tobytes())
  return h.hexdigest()[:16]
