"""Filling the target module's variables (`transformer.Transformer`'s "params"
collection) from per-tensor host arrays.

Checkpoint readers (hf.py, gguf_loader.py) supply host numpy arrays already in
the target layout (`[in, out]`); this module checks them against the shapes
the module declares, stacks the layers on axis 0 and moves them to the device
in the requested dtype. It also computes the target's fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax import checks
from flexdraft_jax.model import pytree, transformer
from flexdraft_jax.model.config import FlexDraftError, ModelConfig

# fetch_global(key) / fetch_layer(key, i) -> host array in target layout.
FetchGlobal = Callable[[str], np.ndarray]
FetchLayer = Callable[[str, int], np.ndarray]


def _checked(x: np.ndarray, want: tuple, what: str) -> np.ndarray:
  if tuple(x.shape) != tuple(want):
    raise FlexDraftError(f"tensor {what} has shape {tuple(x.shape)}, config implies {want}")
  return x


LAYOUTS = ("stacked", "layers")


def check_layout(layout: str) -> None:
  checks.check_choice("layout", layout, LAYOUTS)


def build_params(cfg: ModelConfig, fetch_global: FetchGlobal, fetch_layer: FetchLayer,
                 dtype, layout: str = "stacked") -> dict:
  """The target module's "params" collection in either layout, filled one key
  at a time, so host memory holds at most one stacked tensor beyond the result.

  layout: "stacked" (`layers[key]` is `[n, ...]`; training scans over it) or
    "layers" (`layers[i][key]`, the matmul weights transposed as KEY + "_t":
    what decoding reads, without ever building the stacked copy; see
    `pytree.decode_layer`).
  """
  check_layout(layout)
  model = transformer.Transformer(cfg, layout, dtype=dtype)
  want = jax.eval_shape(lambda: model.init(jax.random.key(0), method="weights"))["params"]
  params = {k: jnp.asarray(_checked(fetch_global(k), want[k].shape, k), dtype=dtype)
            for k in want if k != "layers"}
  if layout == "layers":
    params["layers"] = [pytree.decode_layer(
        {key: jnp.asarray(_checked(fetch_layer(key, i), shape, f"{key}[layer {i}]"),
                          dtype=dtype) for key, shape in pytree.layer_shapes(cfg).items()})
        for i in range(cfg.num_layers)]
  else:
    layers = {}
    for key, shape in pytree.layer_shapes(cfg).items():
      per_layer = [_checked(fetch_layer(key, i), shape, f"{key}[layer {i}]")
                   for i in range(cfg.num_layers)]
      layers[key] = jnp.asarray(np.stack(per_layer), dtype=dtype)
      del per_layer
    params["layers"] = layers
  if jax.tree.structure(params) != jax.tree.structure(want):
    raise FlexDraftError(f"the checkpoint's tensors do not fill the model's parameters "
                         f"({jax.tree.structure(params)} vs {jax.tree.structure(want)})")
  return params


_FINGERPRINT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                       "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling",
                       "rms_norm_eps", "qk_norm", "attention_bias", "tie_embeddings")


def _fingerprint_slices(params) -> list:
  leaf = lambda k, i: pytree.layer_leaf(params, k, i)
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
