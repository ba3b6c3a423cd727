"""Does a drafter fit a target? One-line refusals when it does not."""

from __future__ import annotations

from flexdraft_jax.model import transformer
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
  want = set(k for k in transformer.layer_keys(target.params) if k in p["layers"])
  if set(p["layers"]) != want or any(
      p["layers"][k].shape[1:] != transformer.layer_leaf(target.params, k, 0).shape
      for k in want):
    raise FlexDraftError("drafter attention shapes do not match the target's layers")
  out = p["calib"]["w2"].shape[1]
  if out != (cfg.hidden_size if dcfg.calib_tied else cfg.vocab_size):
    raise FlexDraftError(f"drafter calibration head has {out} outputs; the target's "
                         f"vocabulary is {cfg.vocab_size}")
  fp = getattr(drafter, "target_fingerprint", "")
  if fp and fp != target.fingerprint:
    raise FlexDraftError(f"drafter was trained for another target (fingerprint {fp}, "
                         f"this target is {target.fingerprint})")
