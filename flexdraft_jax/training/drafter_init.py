"""A run's starting drafter: its draft vocabulary and a warm start from a
trained drafter."""

from __future__ import annotations

import os

import jax
import numpy as np

from flexdraft_jax.drafter.model import Drafter
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.training import data


def draft_vocab(workdir, records, size: int, cfg) -> np.ndarray:
  """The draft vocabulary of a run: made from the training records once and
  kept in WORKDIR/draft_vocab.npy, so a resumed run keeps it when data is added."""
  path = workdir and os.path.join(workdir, "draft_vocab.npy")
  if path and os.path.exists(path):
    vocab = np.load(path)
    if vocab.shape != (size,):
      raise FlexDraftError(f"{path} holds {vocab.shape[0]} ids, the config asks "
                           f"draft_vocab={size}; use a new --workdir")
    return vocab
  vocab = data.draft_vocabulary(records, size, cfg.vocab_size, cfg.eos_token_ids)
  if path and jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    np.save(path + ".tmp.npy", vocab)
    os.replace(path + ".tmp.npy", path)
  return vocab


def warm_start(params, source: Drafter, cfg, dcfg) -> dict:
  """`params` (a fresh draft pytree) with the weights of a trained drafter: the
  mask and attention as they are, the calibration output columns matched by
  token id (ids the source never drafted: zero weights, and the mean bias of
  the source's rarest ids). Draft layers match
  from the top: a source with fewer layers fills this config's last ones (the
  others keep their init, copies of the target's projectors), one with more
  gives its last ones."""
  src = source.params
  out = jax.tree.map(np.asarray, params)
  have, want = src["layers"]["q"].shape, out["layers"]["q"].shape
  if have[1:] != want[1:] or set(src["layers"]) != set(out["layers"]):
    raise FlexDraftError(f"init_from drafter has draft layers of shape {have}, this "
                         f"config {want}")
  n = min(have[0], want[0])
  for key, x in src["layers"].items():
    layers = np.array(out["layers"][key])
    layers[want[0] - n:] = np.asarray(x)[have[0] - n:]
    out["layers"][key] = layers
  out["mask"] = np.broadcast_to(np.asarray(src["mask"]), out["mask"].shape).copy()
  if "bonus_in" in src and "bonus_in" in out:
    out["bonus_in"] = np.asarray(src["bonus_in"])
  for k in ("w1", "b1"):
    out["calib"][k] = np.asarray(src["calib"][k])
  w2, b2 = np.asarray(src["calib"]["w2"]), np.asarray(src["calib"]["b2"])
  if source.config.calib_tied or dcfg.calib_tied or w2.shape[0] != out["calib"]["w2"].shape[0]:
    if w2.shape != out["calib"]["w2"].shape:
      raise FlexDraftError("init_from drafter's calibration MLP does not match this "
                           f"config ({w2.shape} vs {out['calib']['w2'].shape})")
    out["calib"]["w2"], out["calib"]["b2"] = w2, b2
    return out
  src_ids = np.asarray(src["vocab"]) if "vocab" in src else np.arange(cfg.vocab_size)
  full_w2 = np.zeros((w2.shape[0], cfg.vocab_size), w2.dtype)
  # Ids the source never drafted were rarer in its data than all it knew (its
  # vocabulary is in frequency order): they start at the mean bias of its rarest
  # quarter. The bias is what sets rare ids apart (the default drafter's run from
  # -2 on its most frequent ids to -5.8 on its rarest): at zero every new id
  # would outscore the ids the source learned.
  unseen = float(np.mean(b2[-max(1, len(b2) // 4):])) if "vocab" in src else 0.0
  full_b2 = np.full((cfg.vocab_size,), unseen, b2.dtype)
  full_w2[:, src_ids], full_b2[src_ids] = w2, b2
  dst_ids = np.asarray(out["vocab"]) if "vocab" in out else np.arange(cfg.vocab_size)
  out["calib"]["w2"], out["calib"]["b2"] = full_w2[:, dst_ids], full_b2[dst_ids]
  return out
