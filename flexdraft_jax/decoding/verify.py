"""Verification (SPEC §3) and selective-verification lengths (SPEC §2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flexdraft_jax.decoding.sampling import SamplingParams, processed_logits, target_tokens
from flexdraft_jax.decoding.state import (DRAFT_KEY_OFFSET, DecodeState, deep_pass,
                                         draft_tokens, emit, record_tokens)
from flexdraft_jax.model import transformer

STRATEGIES = ("cumulative_product", "min_confidence")


def selective_vlen(conf_BxD, theta, strategy: str):
  """How many drafts to verify: leading slots whose confidence passes θ, in [1, D]."""
  D = conf_BxD.shape[1]
  score = jnp.cumprod(conf_BxD, axis=1) if strategy == "cumulative_product" else conf_BxD
  passing = jnp.cumprod(score >= theta, axis=1)
  return jnp.clip(jnp.sum(passing, axis=1), 1, D).astype(jnp.int32)


def verify_block(target_params, cfg, h_BxkxH, state: DecodeState, vlen_B,
                 sp: SamplingParams):
  """Target tokens y_i at every verify position and the accepted count a.

  The verify block `[b, d1 .. d_{k-1}]` may be shorter than the drafter's block
  (k ≤ bs): only its k - 1 drafts can be accepted. Drafts are deterministic, so
  accepting while the sampled `y_i == d_{i+1}` is exact rejection sampling for
  a point-mass draft: lossless at any T.
  """
  key = jax.random.fold_in(state.key, state.steps)
  D = h_BxkxH.shape[1] - 1
  if sp.sampled_drafts:
    lg = transformer.Transformer.of(cfg, target_params).apply(
        transformer.variables(target_params), h_BxkxH, method="logits")
    return leviathan(lg, state, vlen_B, sp, key)
  y = target_tokens(target_params, cfg, h_BxkxH, key, sp)
  ok = (y[:, :D] == state.drafts_BxD[:, :D]) & (jnp.arange(D)[None] < vlen_B[:, None])
  a = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
  return y, a


def leviathan(lg_BxbsxV, state: DecodeState, vlen_B, sp: SamplingParams, key):
  """Rejection sampling for drafts sampled from q (Leviathan et al.): accept d
  with probability min(1, p(d)/q(d)); at the first rejection sample the
  residual norm(max(p - q, 0)); if all `vlen` are accepted, sample p.

  Returns (y, a) laid out like the exact-match rule: y[a] is the new bonus.
  """
  p = jax.nn.softmax(processed_logits(lg_BxbsxV, sp), axis=-1)
  D = lg_BxbsxV.shape[1] - 1
  d, q = state.drafts_BxD[:, :D], state.q_BxDxV[:, :D]
  B = d.shape[0]
  k_accept, k_bonus = jax.random.split(key)
  p_d = jnp.take_along_axis(p[:, :D], d[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(q, d[..., None], axis=-1)[..., 0]
  u = jax.random.uniform(k_accept, (B, D))
  ok = (u * q_d < p_d) & (jnp.arange(D)[None] < vlen_B[:, None])
  a = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
  p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
  q_a = jnp.take_along_axis(jnp.pad(q, ((0, 0), (0, 1), (0, 0))), a[:, None, None],
                            axis=1)[:, 0]
  resid = jnp.where((a < vlen_B)[:, None], jnp.maximum(p_a - q_a, 0.0), p_a)
  resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, p_a)
  bonus = jax.random.categorical(k_bonus, jnp.log(resid)).astype(jnp.int32)
  y = jnp.pad(d, ((0, 0), (0, 1)))
  y = jnp.where(jnp.arange(D + 1)[None] == a[:, None], bonus[:, None], y)
  return y, a


def commit(state: DecodeState, y_Bxbs, a_B, cache, *, max_new,
           stop_ids) -> DecodeState:
  """Emits d1..da and the new bonus y_a; advances the committed length by a+1.
  (`y` spans the verify block, k ≤ bs positions.)"""
  B, k = y_Bxbs.shape
  j = jnp.arange(k)[None]
  bonus = jnp.take_along_axis(y_Bxbs, a_B[:, None], axis=1)[:, 0]
  drafts = jnp.pad(state.drafts_BxD[:, :k - 1], ((0, 0), (0, 1)))
  new = jnp.where(j < a_B[:, None], drafts, bonus[:, None])
  live = ~state.done_B
  out, n_out, done, _ = emit(state, new, a_B + 1, max_new, stop_ids)
  hist = record_tokens(state.hist_BxL, state.length_B, new, a_B + 1, live)
  return state._replace(
      hist_BxL=hist,
      cache=cache,
      length_B=jnp.where(live, state.length_B + a_B + 1, state.length_B),
      bonus_B=jnp.where(live, bonus, state.bonus_B),
      out_BxO=out, n_out_B=n_out, done_B=done, steps=state.steps + 1,
      accept_hist=state.accept_hist.at[a_B + 1].add(live.astype(jnp.int32)))


def set_drafts(target_params, cfg, drafter, state: DecodeState, hm_BxbsxH,
               old: DecodeState, sp: SamplingParams) -> DecodeState:
  """New drafts from one mask group's hidden states and the (new) bonus."""
  key = jax.random.fold_in(state.key, DRAFT_KEY_OFFSET + state.steps)
  d = draft_tokens(target_params, cfg, drafter, hm_BxbsxH, state.bonus_B, sp, key,
                   state.hist_BxL, state.length_B, top=old.cand_BxDxC.shape[2])
  live = ~old.done_B
  keep = lambda new, was: jnp.where(live.reshape((-1,) + (1,) * (new.ndim - 1)), new, was)
  return state._replace(drafts_BxD=keep(d.ids_BxD, old.drafts_BxD),
                        conf_BxD=keep(d.conf_BxD, old.conf_BxD),
                        q_BxDxV=keep(d.q_BxDxV, old.q_BxDxV),
                        cand_BxDxC=keep(d.cand_BxDxC, old.cand_BxDxC),
                        cand_lp_BxDxC=keep(d.cand_lp_BxDxC, old.cand_lp_BxDxC))


def refresh_drafts(target_params, cfg, drafter, state: DecodeState, *,
                   sp: SamplingParams, attn_impl: str = "xla") -> DecodeState:
  """One mask group on the bonus's position through the deep layers only."""
  hm = deep_pass(target_params, cfg, drafter, state.cache, state.length_B,
                 state.bonus_B, attn_impl)
  return set_drafts(target_params, cfg, drafter, state, hm, state, sp)
