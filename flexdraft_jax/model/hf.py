"""Loading an HF safetensors checkpoint directory (Llama / Qwen2 / Qwen3)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from safetensors import safe_open

from flexdraft_jax.model import weights
from flexdraft_jax.model.config import FlexDraftError, ModelConfig, rope_scaling_tuple
from flexdraft_jax.model.tokenizer import Tokenizer

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3"}

# target key -> HF tensor name; layer names get the prefix `model.layers.{i}.`.
_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                 "lm_head": "lm_head.weight"}
_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}
_MATRICES = ("q", "k", "v", "o", "gate", "up", "down", "lm_head")


def _read_json(path: str, what: str) -> dict:
  if not os.path.isfile(path):
    raise FlexDraftError(f"missing {what}: {path}")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise FlexDraftError(f"cannot parse {path}: {e}") from e


def _as_ids(value) -> tuple:
  if value is None:
    return ()
  return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _rope(raw: dict) -> tuple:
  """(rope_theta, rope_scaling tuple) from `rope_parameters` (transformers 5) or legacy keys."""
  params = raw.get("rope_parameters")
  if isinstance(params, dict):
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
  else:
    theta, scaling = raw.get("rope_theta", 10000.0), raw.get("rope_scaling")
  return float(theta), rope_scaling_tuple(scaling)


def _architecture(raw: dict, path: str) -> str:
  archs = raw.get("architectures") or []
  name = archs[0] if archs else None
  if name in ARCHITECTURES:
    return ARCHITECTURES[name]
  shown = name or f"model_type={raw.get('model_type')!r}"
  raise FlexDraftError(f"unsupported architecture {shown} in {path} "
                       f"(supported: {', '.join(ARCHITECTURES)})")


def _check_supported(raw: dict, family: str, path: str):
  """Raises for config options the functional decoder does not implement."""
  if raw.get("hidden_act", "silu") != "silu":
    raise FlexDraftError(f"unsupported hidden_act {raw['hidden_act']!r} in {path}")
  if raw.get("mlp_bias"):
    raise FlexDraftError(f"unsupported mlp_bias=true in {path}")
  if family != "qwen2" and raw.get("attention_bias"):
    raise FlexDraftError(f"unsupported attention_bias=true (o_proj bias) in {path}")
  if raw.get("use_sliding_window"):
    raise FlexDraftError(f"unsupported use_sliding_window=true in {path}")


def read_config(path: str) -> ModelConfig:
  """ModelConfig from `path/config.json`."""
  cfg_file = os.path.join(path, "config.json")
  raw = _read_json(cfg_file, "config.json")
  family = _architecture(raw, cfg_file)
  _check_supported(raw, family, cfg_file)
  try:
    return _model_config(raw, family)
  except FlexDraftError:
    raise
  except KeyError as e:
    raise FlexDraftError(f"{cfg_file} lacks the key {e.args[0]!r}") from e
  except (TypeError, ValueError) as e:
    raise FlexDraftError(f"malformed value in {cfg_file}: {e}") from e


def _model_config(raw: dict, family: str) -> ModelConfig:
  heads = int(raw["num_attention_heads"])
  theta, scaling = _rope(raw)
  return ModelConfig(
      vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
      intermediate_size=int(raw["intermediate_size"]),
      num_layers=int(raw["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(raw.get("num_key_value_heads") or heads),
      head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
      rope_theta=theta, rope_scaling=scaling,
      rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
      qk_norm=family == "qwen3", attention_bias=family == "qwen2",
      tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
      max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
      bos_token_id=raw.get("bos_token_id"), eos_token_ids=_as_ids(raw.get("eos_token_id")),
      pad_token_id=int(raw.get("pad_token_id") or 0), model_type=family)


class SafetensorsIndex:
  """Name -> host numpy array over a single or sharded safetensors checkpoint."""

  def __init__(self, path: str):
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
      files = [single]
      self.where = None
    elif os.path.isfile(index):
      weight_map = _read_json(index, "safetensors index").get("weight_map", {})
      files = sorted({os.path.join(path, f) for f in weight_map.values()})
      self.where = {k: os.path.join(path, f) for k, f in weight_map.items()}
    else:
      raise FlexDraftError(
          f"missing weights: neither model.safetensors nor model.safetensors.index.json in {path}")
    self._cpu = jax.devices("cpu")[0]
    self._handles = {f: self._open(f) for f in files}
    if self.where is None:
      self.where = {k: single for k in self._handles[single].keys()}

  def _open(self, file: str):
    if not os.path.isfile(file):
      raise FlexDraftError(f"missing weights shard {file}")
    try:
      return safe_open(file, framework="flax")
    except Exception as e:  # SafetensorError is not importable as a class
      raise FlexDraftError(f"corrupt or truncated safetensors file {file}: {e}") from e

  def __contains__(self, name: str) -> bool:
    return name in self.where

  def get(self, name: str) -> np.ndarray:
    """The tensor as a host numpy array (bf16 via ml_dtypes)."""
    if name not in self.where:
      raise FlexDraftError(f"missing tensor {name} in the checkpoint")
    file = self.where[name]
    try:
      with jax.default_device(self._cpu):
        return np.asarray(self._handles[file].get_tensor(name))
    except Exception as e:
      raise FlexDraftError(f"cannot read tensor {name} from {file}: {e}") from e


def load_hf_dir(path: str, dtype, layout: str = "stacked") -> tuple:
  """(ModelConfig, params, Tokenizer or None) of an HF checkpoint directory."""
  cfg = read_config(path)
  store = SafetensorsIndex(path)
  if _GLOBAL_NAMES["lm_head"] not in store:
    cfg = dataclasses.replace(cfg, tie_embeddings=True)

  def fetch(key: str, name: str) -> np.ndarray:
    x = store.get(name)
    return x.T if key in _MATRICES else x

  params = weights.build_params(
      cfg, lambda k: fetch(k, _GLOBAL_NAMES[k]),
      lambda k, i: fetch(k, f"model.layers.{i}.{_LAYER_NAMES[k]}"), dtype, layout)
  tokenizer = None
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    tokenizer = Tokenizer.from_hf_dir(path, bos_token_id=cfg.bos_token_id,
                                      eos_token_ids=cfg.eos_token_ids + _generation_eos(path))
  return cfg, params, tokenizer


def _generation_eos(path: str) -> tuple:
  gen = os.path.join(path, "generation_config.json")
  if not os.path.isfile(gen):
    return ()
  return _as_ids(_read_json(gen, "generation_config.json").get("eos_token_id"))
