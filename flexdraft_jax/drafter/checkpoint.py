"""A drafter on disk: one self-describing directory.

  PATH/drafter.json        {"format", "version", "config": DrafterConfig,
                            "target": {name, fingerprint, num_layers,
                                       hidden_size, vocab_size},
                            "training": {...}, "tensors": {key: [shape]}}
  PATH/params.safetensors  the draft pytree, flattened with "/" keys, bf16.

Saving is atomic (written beside PATH, then renamed into place). Loading checks
the drafter against the target it is loaded for and casts to the target dtype.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import numpy as st_numpy

from flexdraft_jax import checks
from flexdraft_jax.drafter.model import (Drafter, DrafterConfig, check_vocab,
                                         init_draft_params)
from flexdraft_jax.model.config import FlexDraftError, Target

FORMAT = "flexdraft-drafter"
VERSION = 1
META_FILE = "drafter.json"
TENSOR_FILE = "params.safetensors"


def flatten(tree, prefix: str = "") -> dict:
  """Nested dicts of arrays -> {"a/b/c": array}."""
  out = {}
  for k, v in tree.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flatten(v, key + "/"))
    else:
      out[key] = v
  return out


def unflatten(flat: dict) -> dict:
  out: dict = {}
  for key, v in flat.items():
    node = out
    *parents, leaf = key.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return out


def target_record(target) -> dict:
  cfg = target.config
  return {"name": target.name, "fingerprint": target.fingerprint,
          "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
          "vocab_size": cfg.vocab_size}


def save_drafter(path: str, drafter: Drafter, target, *,
                 training: Optional[dict] = None) -> str:
  """Writes `drafter` (made for `target`) to the directory `path`, atomically.

  `training` is a free-form record (data, steps, tokens seen, metrics).
  Returns the path.
  """
  path = os.path.abspath(path)
  fingerprint = drafter.target_fingerprint or target.fingerprint
  if fingerprint != target.fingerprint:
    raise FlexDraftError(
        f"drafter was made for target fingerprint {fingerprint}, not "
        f"{target.fingerprint} ({target.name})")
  flat = {k: _stored(np.asarray(jax.device_get(v)), exact=k.startswith("ngram/"))
          for k, v in flatten(drafter.params).items() if k != "head"}
  meta = {"format": FORMAT, "version": VERSION,
          "config": dataclasses.asdict(drafter.config),
          "target": target_record(target),
          "training": training or {},
          "tensors": {k: list(v.shape) for k, v in sorted(flat.items())}}
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
  try:
    os.chmod(tmp, 0o755 & ~_umask())  # mkdtemp makes it private
    st_numpy.save_file(flat, os.path.join(tmp, TENSOR_FILE))
    with open(os.path.join(tmp, META_FILE), "w") as f:
      json.dump(meta, f, indent=1, sort_keys=True)
    os.chmod(os.path.join(tmp, TENSOR_FILE), 0o644 & ~_umask())
    if os.path.isdir(path):  # the rest of a drafter written over (its card) stays
      for name in os.listdir(path):
        if name not in (TENSOR_FILE, META_FILE):
          src = os.path.join(path, name)
          (shutil.copytree if os.path.isdir(src) else shutil.copy2)(
              src, os.path.join(tmp, name))
    old = None
    if os.path.exists(path):
      old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=parent)
      os.rename(path, os.path.join(old, "d"))
    os.rename(tmp, path)
    if old:
      shutil.rmtree(old, ignore_errors=True)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return path


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def _stored(x: np.ndarray, exact: bool = False) -> np.ndarray:
  """Weights as bf16; integer leaves (the draft vocabulary, n-gram keys) as
  int32; `exact` floats (the n-gram counts) as float32."""
  if np.issubdtype(x.dtype, np.integer):
    return x.astype(np.int32)
  if exact:
    return x.astype(np.float32)
  return x.astype(ml_dtypes.bfloat16)


def read_meta(path: str) -> dict:
  """The drafter.json of a saved drafter; FlexDraftError if missing or corrupt."""
  meta_path = os.path.join(path, META_FILE)
  if not os.path.isdir(path):
    raise FlexDraftError(f"no drafter at {path} (not a directory)")
  if not os.path.isfile(meta_path):
    raise FlexDraftError(f"no drafter at {path} ({META_FILE} missing)")
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise FlexDraftError(f"corrupt drafter at {path}: {META_FILE}: {e}") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise FlexDraftError(f"corrupt drafter at {path}: {META_FILE} is not a "
                         f"{FORMAT} record")
  if meta.get("version") != VERSION:
    raise FlexDraftError(f"drafter at {path} has format version "
                         f"{meta.get('version')}, this code reads {VERSION}")
  return meta


def drafter_folder_target(path) -> Optional[str]:
  """None unless `path` is a drafter folder (it holds drafter.json); then the
  name of the target it was made for ('' where drafter.json does not say)."""
  if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(
      os.path.join(os.path.expanduser(path), META_FILE)):
    return None
  try:
    return str(read_meta(os.path.expanduser(path))["target"]["name"])
  except (FlexDraftError, KeyError, TypeError):
    return ""


def check_target(meta: dict, target, path: str = "drafter") -> None:
  """Refuses (one line) a drafter whose recorded target differs from `target`."""
  want = target_record(target)
  got = meta.get("target", {})
  for key in ("num_layers", "hidden_size", "vocab_size", "fingerprint"):
    if got.get(key) != want[key]:
      raise FlexDraftError(
          f"{path} was made for target {got.get('name')!r} ({key}="
          f"{got.get(key)}), not {want['name']!r} ({key}={want[key]})")


def load_drafter(path: str, target) -> Drafter:
  """Reads a drafter saved by `save_drafter`, checked against `target` and cast
  to the target's dtype."""
  checks.check_path("path", path, "a drafter folder (str)")
  checks.check_loaded("target", target, Target, "fd.load_target({})")
  path = os.fspath(path)
  meta = read_meta(path)
  check_target(meta, target, path)
  try:
    dcfg = DrafterConfig(**meta["config"])
  except (KeyError, TypeError) as e:
    raise FlexDraftError(f"corrupt drafter at {path}: bad config ({e})") from None
  dcfg.validate(target.config)
  tensor_path = os.path.join(path, TENSOR_FILE)
  if not os.path.isfile(tensor_path):
    raise FlexDraftError(f"corrupt drafter at {path}: {TENSOR_FILE} missing")
  try:
    flat = st_numpy.load_file(tensor_path)
  except Exception as e:  # safetensors raises several types on bad bytes
    raise FlexDraftError(f"corrupt drafter at {path}: {TENSOR_FILE}: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                         ) from None
  dtype = target.params["embed"].dtype
  vocab = None
  if dcfg.draft_vocab:
    vocab = jax.ShapeDtypeStruct((dcfg.draft_vocab,), jnp.int32)
  expected = flatten(jax.eval_shape(
      lambda tp: init_draft_params(tp, target.config, dcfg, jax.random.PRNGKey(0),
                                   dtype, vocab=vocab), target.params))
  if sorted(flat) != sorted(expected):
    missing = sorted(set(expected) - set(flat)) or sorted(set(flat) - set(expected))
    raise FlexDraftError(f"corrupt drafter at {path}: tensors do not match its "
                         f"config (first difference: {missing[0]})")
  for k, v in flat.items():
    if tuple(v.shape) != tuple(expected[k].shape):
      raise FlexDraftError(f"corrupt drafter at {path}: {k} has shape "
                           f"{tuple(v.shape)}, expected {tuple(expected[k].shape)}")
  if "vocab" in flat:
    check_vocab(flat["vocab"], dcfg.draft_vocab, target.config.vocab_size)
  params = unflatten({k: jnp.asarray(v) if np.issubdtype(v.dtype, np.integer) else
                      jnp.asarray(v.astype(np.float32), dtype) for k, v in flat.items()})
  return Drafter(dcfg, params, meta["target"]["fingerprint"])
