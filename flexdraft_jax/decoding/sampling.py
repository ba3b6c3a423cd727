"""Turning target logits into tokens: greedy, temperature, top-k, top-p."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from flexdraft_jax import checks
from flexdraft_jax.model import transformer
from flexdraft_jax.model.config import FlexDraftError

# The smallest temperature > 0 sampling takes. Logits x are divided by T in
# float32, whose spacing at x / T is |x| / T * 2**-23, and a softmax subtracts
# the largest x / T, which the compiled program may round differently (XLA
# computes x / T again inside its fusions). Once that spacing nears exp's
# range (87) every probability underflows to 0 and the softmax is 0 / 0 = NaN:
# a tiny target (logits ~ 3) emitted ids 0 from T = 1e-9 on, with sampled drafts;
# below 2**-126 (1.2e-38) the device flushes T itself to 0, and every mode, AR
# too, emitted ids 0, 1, 2. From 1e-6 on, x / T stays below 1e8 for logits up to
# 100 in magnitude (models give tens): a spacing of 8 at most. Nothing is lost
# by the bound: at T = 1e-6 a token whose logit is 1e-4 below the best is already
# e^-100 less likely (0 in float32); a smaller T differs from greedy decoding only
# among tokens tied closer than that.
MIN_TEMPERATURE = 1e-6


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 0.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None
  # Sample drafts from the draft distribution and verify them with Leviathan
  # rejection sampling (SPEC §3) instead of drafting the argmax (T > 0 only).
  # None (auto): sampled at T > 0, except with draft trees, whose nodes are
  # the likeliest drafts (`resolved`). Sampled drafts are accepted wherever q
  # and p_T overlap, an argmax draft only with p_T(draft): at T = 1 sequential
  # decoding's τ reads 1.85 against 1.61 (docs/results/acceptance_match.md).
  draft_sampling: Optional[bool] = None

  def __post_init__(self):
    checks.check_number("temperature", self.temperature, "a finite number >= 0",
                        lambda t: math.isfinite(t) and t >= 0)
    if 0 < self.temperature < MIN_TEMPERATURE:
      raise FlexDraftError(f"temperature must be 0 (greedy) or >= "
                           f"{MIN_TEMPERATURE:g}, got {checks.shown(self.temperature)}")
    if self.top_k is not None:
      checks.check_int("top_k", self.top_k, 1)
    if self.top_p is not None:
      checks.check_number("top_p", self.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
    if self.draft_sampling is not None:
      checks.check_bool("draft_sampling", self.draft_sampling, "True, False or None (auto)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  @property
  def sampled_drafts(self) -> bool:
    return self.draft_sampling is not False and not self.greedy

  def resolved(self, trees: bool) -> "SamplingParams":
    """`draft_sampling` decided: None (auto) is on at T > 0 without draft
    trees, else off (at T = 0 the same params as an explicit False: the
    decode programs take them as a static argument, one program each)."""
    if self.draft_sampling is not None:
      return self
    return dataclasses.replace(self, draft_sampling=not trees and not self.greedy)


def processed_logits(logits_xV, sp: SamplingParams):
  """Logits of the distribution actually sampled from (temperature, top-k, top-p)."""
  x = logits_xV.astype(jnp.float32) / sp.temperature
  if sp.top_k is not None and sp.top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, sp.top_k)[0][..., -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if sp.top_p is not None and sp.top_p < 1.0:
    sorted_desc = -jnp.sort(-x, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the top token).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    cutoff_idx = jnp.sum(mass_before < sp.top_p, axis=-1, keepdims=True) - 1
    cutoff = jnp.take_along_axis(sorted_desc, cutoff_idx, axis=-1)
    x = jnp.where(x < cutoff, -jnp.inf, x)
  return x


def sample(logits_xV, key, sp: SamplingParams):
  """One token per row of `logits_[...]xV`: argmax at T=0, else a sample."""
  if sp.greedy:
    return jnp.argmax(logits_xV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, processed_logits(logits_xV, sp)).astype(jnp.int32)


def target_tokens(target_params, cfg, h_BxTxH, key, sp: SamplingParams):
  """The target's token `[B, T]` after each hidden state: the argmax at T=0
  (`transformer.greedy_tokens`, no `[B, T, V]` logits), else a sample."""
  model, variables = transformer.Transformer.of(cfg, target_params), {"params": target_params}
  if sp.greedy:
    return model.apply(variables, h_BxTxH, method="greedy_tokens")
  return sample(model.apply(variables, h_BxTxH, method="logits"), key, sp)
