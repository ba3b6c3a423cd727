"""Does a drafter fit a target? One-line refusals when it does not."""

from __future__ import annotations

from flexdraft_jax.model import pytree
from flexdraft_jax.model.config import FlexDraftError


def check_compatible(drafter, target) -> None:
  """Raises FlexDraftError naming the first mismatch between drafter and target."""
  cfg, dcfg, p = target.config, drafter.config, drafter.params
  dcfg.validate(cfg)
  if p["mask"].shape != (cfg.hidden_size,):
    raise FlexDraftError(
        f"drafter hidden size {p['mask'].shape[0]} does not match the target's "
        f"{cfg.hidden_size}")
  n_draft = p["layers"]["q"].shape[0]
  if n_draft != dcfg.num_layers:
    raise FlexDraftError(f"drafter has {n_draft} draft layers but its config says "
                         f"{dcfg.num_layers}")
  want = set(k for k in pytree.layer_keys(target.params) if k in p["layers"])
  if set(p["layers"]) != want or any(
      p["layers"][k].shape[1:] != pytree.layer_leaf(target.params, k, 0).shape
      for k in want):
    raise FlexDraftError("drafter attention shapes do not match the target's layers")
  if dcfg.draft_vocab:
    vocab = p.get("vocab")
    if vocab is None or vocab.shape != (dcfg.draft_vocab,):
      raise FlexDraftError(f"drafter config says draft_vocab={dcfg.draft_vocab} but "
                           f"its vocabulary has shape {getattr(vocab, 'shape', None)}")
    if int(vocab.min()) < 0 or int(vocab.max()) >= cfg.vocab_size:
      raise FlexDraftError(f"drafter vocabulary holds ids outside the target's "
                           f"vocabulary [0, {cfg.vocab_size})")
  elif "vocab" in p:
    raise FlexDraftError("drafter has a draft vocabulary but its config says "
                         "draft_vocab=0")
  out = p["calib"]["w2"].shape[1]
  want = cfg.hidden_size if dcfg.calib_tied else (dcfg.draft_vocab or cfg.vocab_size)
  if out != want:
    raise FlexDraftError(f"drafter calibration head has {out} outputs, expected {want} "
                         f"(target vocabulary {cfg.vocab_size}, draft vocabulary "
                         f"{dcfg.draft_vocab or 'full'})")
  fp = getattr(drafter, "target_fingerprint", "")
  if fp and fp != target.fingerprint:
    raise FlexDraftError(f"drafter was trained for another target (fingerprint {fp}, "
                         f"this target is {target.fingerprint})")
