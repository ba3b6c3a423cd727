"""Decode state shared by every mode, and the prefill that creates it.

Invariant (SPEC §2): the cache holds positions `0..length-1` of each row; the
current `bonus` token sits at position `length` and is not yet in the cache;
`drafts` are the guesses for positions `length+1 .. length+bs-1`.
Output tokens are appended to `out` as they are decided (the bonus included).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from flexdraft_jax.decoding.sampling import (SamplingParams, processed_logits,
                                            target_tokens)
from flexdraft_jax.drafter import model as drafter_model
from flexdraft_jax.model import pytree, transformer


# The engine reads the cache in blocks of this many positions, up to the
# longest live row (cache capacities are multiples of it).
KV_BLOCK = 128


class DecodeState(NamedTuple):
  cache: pytree.KVCache
  length_B: jax.Array      # int32, committed length c
  bonus_B: jax.Array       # int32, token at position c
  drafts_BxD: jax.Array    # int32 [B, bs-1] (D = 0 without a drafter)
  conf_BxD: jax.Array      # f32, max draft probability of each draft
  q_BxDxV: jax.Array       # f32 draft distributions (sampled drafts only; else V = 0)
  out_BxO: jax.Array       # int32 output buffer
  n_out_B: jax.Array       # int32 tokens emitted
  done_B: jax.Array        # bool
  key: jax.Array
  steps: jax.Array         # int32 target forwards (verification steps)
  accept_hist: jax.Array   # int32 [bs+1]: histogram of tokens committed per step
  # int32 [B, P + O + 1]: the token at each position through the bonus (-1
  # after it), for a drafter whose n-gram prior reads the row's text; else [B, 0]
  hist_BxL: jax.Array
  # Draft trees (decoding/tree.py; C = 0 without): each slot's C likeliest
  # draft-vocabulary indices by the calibrated draft logits before the n-gram
  # prior, best first, int32 [B, D, C], and their log-probabilities [B, D, C]
  cand_BxDxC: jax.Array
  cand_lp_BxDxC: jax.Array


class Drafts(NamedTuple):
  """What a mask block drafts (`draft_tokens`)."""
  ids_BxD: jax.Array      # the drafts (token ids)
  conf_BxD: jax.Array     # their confidences
  q_BxDxV: jax.Array      # draft distributions (sampled drafts; else [B, D, 0])
  cand_BxDxC: jax.Array   # each slot's `top` candidates (draft-vocabulary indices)
  cand_lp_BxDxC: jax.Array  # and their log-probabilities


def emit(state: DecodeState, new_BxE, n_new_B, max_new, stop_ids_S):
  """Appends the first `n_new` of `new_BxE` to each live row's output.

  A row stops after its first stop token (`stop_ids_S`, padded with -1) or at
  `max_new` tokens. Both are traced values: changing them does not recompile.
  Returns (out, n_out, done, n_emitted).
  """
  B, E = new_BxE.shape
  j = jnp.arange(E)[None, :]
  n_new_B = jnp.where(state.done_B, 0, n_new_B)
  is_stop = jnp.any(new_BxE[:, :, None] == stop_ids_S[None, None, :], axis=-1)
  is_stop &= j < n_new_B[:, None]
  first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), E)
  n = jnp.minimum(n_new_B, first_stop + 1)
  n = jnp.minimum(n, max_new - state.n_out_B)
  b_BxE = jnp.broadcast_to(jnp.arange(B)[:, None], (B, E))
  idx = jnp.where(j < n[:, None], state.n_out_B[:, None] + j, state.out_BxO.shape[1])
  out = state.out_BxO.at[b_BxE, idx].set(new_BxE, mode="drop")
  n_out = state.n_out_B + n
  done = state.done_B | (first_stop < n) | (n_out >= max_new)
  return out, n_out, done, n


DRAFT_KEY_OFFSET = 1 << 30  # keeps draft sampling's keys apart from verification's


def draft_tokens(target_params, cfg, drafter, hm_BxbsxH, bonus_B, sp: SamplingParams, key,
                 hist_BxL=None, bonus_at_B=None, top: int = 0) -> Drafts:
  """Drafts d1..d_{bs-1} from mask slots 1.., their confidences and, for sampled
  drafts, their distributions q (else an empty `[B, D, 0]`). `hist[:, :bonus_at
  + 1]` is each row's text through the bonus (the n-gram prior reads it; None:
  no text, the data's n-grams alone). `top` > 0: also each slot's `top`
  likeliest candidates before the prior, for draft trees."""
  h = hm_BxbsxH[:, 1:]
  bonus = jnp.broadcast_to(bonus_B[:, None], h.shape[:2])
  lg = drafter_model.DraftModel.of(cfg, drafter.config, target_params).apply(
      transformer.variables(target_params, drafter.params), h, bonus, method="logits")
  to_ids = lambda idx: drafter_model.to_token_ids(drafter.params, idx.astype(jnp.int32))
  cand = jnp.zeros(h.shape[:2] + (top,), jnp.int32)
  cand_lp = jnp.zeros(h.shape[:2] + (top,), jnp.float32)
  if top:
    cand_lp, cand = jax.lax.top_k(jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1), top)
    cand = jax.lax.optimization_barrier(cand.astype(jnp.int32))
  # Sampled drafts: slot j samples softmax(logits / (T·r_j)), the drafter's
  # fitted per-slot draft temperature (none: r_j = 1).
  ratio_D = drafter_model.draft_temperature_ratios(drafter.config, sp.temperature,
                                                   h.shape[1]) if sp.sampled_drafts else None
  q_logits = lambda lg_xV, j=slice(None): processed_logits(
      lg_xV if ratio_D is None else lg_xV / ratio_D[j, None], sp)
  if drafter.config.rescores:  # each slot re-scored given the drafts before it
    if hist_BxL is None:  # no row text known: the data's n-grams alone
      hist_BxL, bonus_at_B = jnp.zeros((h.shape[0], 0), jnp.int32), jnp.zeros_like(bonus_B)
    if sp.sampled_drafts:
      pick = lambda j, lg_BxV: jax.random.categorical(jax.random.fold_in(key, j),
                                                      q_logits(lg_BxV, j))
    else:
      pick = lambda j, lg_BxV: jnp.argmax(lg_BxV, axis=-1)
    lg, idx = drafter_model.rescored_drafts(cfg, drafter, lg, bonus_B, hist_BxL, bonus_at_B,
                                            pick)
  elif sp.sampled_drafts:
    idx = jax.random.categorical(key, q_logits(lg))
  else:
    idx = jnp.argmax(lg, axis=-1)
  probs_max = jnp.max(jax.nn.softmax(lg, axis=-1), axis=-1)
  if not sp.sampled_drafts:
    return Drafts(to_ids(idx), probs_max, jnp.zeros(h.shape[:2] + (0,), jnp.float32),
                  cand, cand_lp)
  q = drafter_model.to_full_vocab(drafter.params, jax.nn.softmax(q_logits(lg), axis=-1),
                                  cfg.vocab_size)
  return Drafts(to_ids(idx), probs_max, q, cand, cand_lp)


def record_tokens(hist_BxL, length_B, new_BxE, n_new_B, live_B):
  """`hist` with each live row's first `n_new` tokens of `new` at positions
  `length + 1 ..` (what a verification step committed after the old bonus)."""
  B, E = new_BxE.shape
  if hist_BxL.shape[1] == 0:
    return hist_BxL
  j = jnp.arange(E)[None]
  at = jnp.where((j < n_new_B[:, None]) & live_B[:, None], length_B[:, None] + 1 + j,
                 hist_BxL.shape[1])   # out of range: dropped
  return hist_BxL.at[jnp.arange(B)[:, None], at].set(new_BxE, mode="drop")


def mask_block(start_B, limit_B, num_groups: int, bs: int, bonus_B=None):
  """MaskRows for `num_groups` groups; group g at start+g .. start+g+bs-1, limit+g.
  `bonus_B`: the bonus every group drafts after (one group; read by a drafter
  with `bonus_input`)."""
  g_M = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), bs)
  j_M = jnp.tile(jnp.arange(bs, dtype=jnp.int32), num_groups)
  pos = start_B[:, None] + g_M[None, :] + j_M[None, :]
  limit = limit_B[:, None] + g_M[None, :]
  bonus = None if bonus_B is None else jnp.broadcast_to(bonus_B[:, None], pos.shape)
  return pytree.MaskRows(pos_BxM=pos, limit_BxM=limit, group_M=g_M, bonus_BxM=bonus)


def prefill(target_params, cfg, cache, prompt_BxP, plen_B, valid_B, key, *,
            sp: SamplingParams, max_new, out_len: int, stop_ids,
            drafter: Optional[drafter_model.Drafter] = None,
            attn_impl: str = "xla", tree_top: int = 0) -> DecodeState:
  """Prompts through the target (and the first mask block), first token t0.
  `tree_top`: candidates kept per draft slot for draft trees (0: none)."""
  B, P = prompt_BxP.shape
  pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  masks, L, bs = None, 0, 1
  # A drafter that reads the bonus drafts after t0 is known: a deep-layers-only
  # pass below, as in sequential mode.
  joint = drafter is not None and not drafter.config.bonus_input
  if drafter is not None:
    bs = drafter.config.block_size
  if joint:
    L = drafter.config.num_layers
    masks = mask_block(plen_B, plen_B - 1, 1, bs)
  h, hm, cache = transformer.Transformer.of(cfg, target_params).apply(
      transformer.variables(target_params, drafter.params if joint else None), cache,
      prompt_BxP, pos, masks=masks, num_draft_layers=L, attn_impl=attn_impl,
      kv_block=KV_BLOCK, method="forward")
  h_last = jnp.take_along_axis(h, (plen_B - 1)[:, None, None], axis=1)
  key, sub, sub_draft = jax.random.split(key, 3)
  t0 = target_tokens(target_params, cfg, h_last, sub, sp)[:, 0]
  hist = jnp.zeros((B, 0), jnp.int32)
  if drafter is not None and drafter.config.rescores:
    hist = jnp.full((B, P + out_len + 1), -1, jnp.int32)
    hist = hist.at[:, :P].set(jnp.where(pos < plen_B[:, None], prompt_BxP, -1))
    hist = hist.at[jnp.arange(B), plen_B].set(t0)
  if drafter is not None:
    if not joint:
      hm = deep_pass(target_params, cfg, drafter, cache, plen_B, t0, attn_impl)
    d = draft_tokens(target_params, cfg, drafter, hm, t0, sp, sub_draft, hist, plen_B,
                     top=tree_top)
  else:
    d = Drafts(jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0), jnp.float32),
               jnp.zeros((B, 0, 0), jnp.float32), jnp.zeros((B, 0, 0), jnp.int32),
               jnp.zeros((B, 0, 0), jnp.float32))
  state = DecodeState(
      cache=cache, length_B=plen_B.astype(jnp.int32), bonus_B=t0,
      drafts_BxD=d.ids_BxD, conf_BxD=d.conf_BxD, q_BxDxV=d.q_BxDxV,
      cand_BxDxC=d.cand_BxDxC, cand_lp_BxDxC=d.cand_lp_BxDxC,
      out_BxO=jnp.zeros((B, out_len), jnp.int32),
      n_out_B=jnp.zeros((B,), jnp.int32), done_B=~valid_B, key=key,
      steps=jnp.zeros((), jnp.int32), accept_hist=jnp.zeros((bs + 1,), jnp.int32),
      hist_BxL=hist)
  out, n_out, done, _ = emit(state, t0[:, None], jnp.ones((B,), jnp.int32),
                             max_new, stop_ids)
  return state._replace(out_BxO=out, n_out_B=n_out, done_B=done)


def deep_pass(target_params, cfg, drafter, cache, length_B, bonus_B, attn_impl):
  """One mask group on the bonus's position (`length_B`) through the deep
  layers only: its hidden states `[B, bs, H]`."""
  masks = mask_block(length_B, length_B - 1, 1, drafter.config.block_size,
                     bonus_B=bonus_B)
  _, hm, _ = transformer.Transformer.of(cfg, target_params).apply(
      transformer.variables(target_params, drafter.params), cache, None, None,
      masks=masks, num_draft_layers=drafter.config.num_layers, attn_impl=attn_impl,
      kv_block=KV_BLOCK, method="forward")
  return hm
