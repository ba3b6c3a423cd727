"""The draft pytree (SPEC §1): mask vector, deep-layer draft attention, calibration MLP."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax.model import transformer
from flexdraft_jax.model.config import FlexDraftError, ModelConfig


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  num_layers: int = 4        # L: deep layers with draft attention.
  block_size: int = 16       # bs: mask tokens per block.
  calib_rank: int = 256      # r: hidden width of the calibration MLP.
  calib_tied: bool = False   # low-rank head 2H -> r -> H, then the tied LM head.
  calibrate: bool = True     # apply the calibration MLP when drafting (ablation: off).

  def validate(self, cfg: ModelConfig):
    if not 1 <= self.num_layers <= cfg.num_layers:
      raise FlexDraftError(
          f"drafter num_layers={self.num_layers} must be in [1, {cfg.num_layers}]")
    if self.block_size < 2:
      raise FlexDraftError(f"block_size={self.block_size} must be at least 2")
    if self.calib_rank < 1:
      raise FlexDraftError(f"calib_rank={self.calib_rank} must be at least 1")


class Drafter(NamedTuple):
  """A drafter: its static config, its trainable pytree and the target it fits."""
  config: DrafterConfig
  params: Any
  target_fingerprint: str = ""


def init_draft_params(target_params, cfg: ModelConfig, dcfg: DrafterConfig,
                      rng: jax.Array, dtype=None):
  """Draft pytree: attention copies of the last L target layers, a random mask
  vector (0.02·N(0,1)) and a calibration MLP whose last layer is zero (identity)."""
  dcfg.validate(cfg)
  dtype = dtype or target_params["embed"].dtype
  s = cfg.num_layers - dcfg.num_layers
  n = cfg.num_layers
  layers = {k: jnp.stack([transformer.layer_leaf(target_params, k, i) for i in range(s, n)]
                         ).astype(dtype)
            for k in transformer.layer_keys(target_params) if k in transformer.ATTN_KEYS}
  H, r = cfg.hidden_size, dcfg.calib_rank
  out = H if dcfg.calib_tied else cfg.vocab_size
  k_mask, k_w1 = jax.random.split(rng)
  return {
      "mask": (0.02 * jax.random.normal(k_mask, (H,))).astype(dtype),
      "layers": layers,
      "calib": {
          "w1": (jax.random.normal(k_w1, (2 * H, r)) / np.sqrt(2 * H)).astype(dtype),
          "b1": jnp.zeros((r,), dtype),
          "w2": jnp.zeros((r, out), dtype),
          "b2": jnp.zeros((out,), dtype),
      },
  }


def calibration_bias(target_params, cfg: ModelConfig, dcfg: DrafterConfig,
                     calib, x_BxMxH, bonus_BxM):
  """The bonus-guided bias `[B, M, V]` added to draft logits (fp32)."""
  e = transformer.embed(target_params, bonus_BxM).astype(x_BxMxH.dtype)
  z = jax.nn.silu(jnp.concatenate([e, x_BxMxH], -1) @ calib["w1"] + calib["b1"])
  out = z @ calib["w2"] + calib["b2"]
  if not dcfg.calib_tied:
    return out.astype(jnp.float32)
  head = target_params["embed"] if cfg.tie_embeddings else target_params["lm_head"].T
  return jnp.einsum("BMH,VH->BMV", out, head, preferred_element_type=jnp.float32)


def draft_logits(target_params, cfg: ModelConfig, drafter: Drafter,
                 hm_BxMxH, bonus_BxM, *, calibrate: bool = True):
  """Calibrated draft logits `[B, M, V]` from mask hidden states (pre final norm)."""
  base = transformer.logits(target_params, cfg, hm_BxMxH)
  if not (calibrate and drafter.config.calibrate):
    return base
  x = transformer.rms_norm(hm_BxMxH, target_params["final_norm"], cfg.rms_norm_eps)
  return base + calibration_bias(target_params, cfg, drafter.config,
                                 drafter.params["calib"], x, bonus_BxM)


def num_params(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
