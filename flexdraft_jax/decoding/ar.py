"""Plain autoregressive decoding: the baseline, and flex's fallback step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flexdraft_jax.decoding.sampling import SamplingParams, target_tokens
from flexdraft_jax.decoding.state import KV_BLOCK, DecodeState, emit, record_tokens
from flexdraft_jax.model import transformer


def ar_step(target_params, cfg, state: DecodeState, *, sp: SamplingParams,
            max_new, stop_ids, attn_impl: str = "xla") -> DecodeState:
  """Feeds the bonus at position `length`, samples the next token.

  The drafts (if any) go stale: a speculative step after this must refresh them.
  """
  h, _, cache = transformer.Transformer.of(cfg, target_params).apply(
      transformer.variables(target_params), state.cache, state.bonus_B[:, None],
      state.length_B[:, None], attn_impl=attn_impl, kv_block=KV_BLOCK, method="forward")
  y = target_tokens(target_params, cfg, h, jax.random.fold_in(state.key, state.steps),
                    sp)[:, 0]
  live = ~state.done_B
  out, n_out, done, _ = emit(state, y[:, None], jnp.ones_like(y), max_new, stop_ids)
  hist_idx = jnp.minimum(1, state.accept_hist.shape[0] - 1)
  return state._replace(
      cache=cache,
      length_B=state.length_B + live,
      bonus_B=jnp.where(live, y, state.bonus_B),
      out_BxO=out, n_out_B=n_out, done_B=done,
      hist_BxL=record_tokens(state.hist_BxL, state.length_B, y[:, None], jnp.ones_like(y),
                             live),
      steps=state.steps + 1,
      accept_hist=state.accept_hist.at[hist_idx].add(jnp.sum(live)))

