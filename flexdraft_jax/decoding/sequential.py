"""Sequential mode: verify, then draft one branch that reuses the KV cache."""

from __future__ import annotations

import jax.numpy as jnp

from flexdraft_jax.decoding import verify
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.decoding.state import KV_BLOCK, DecodeState
from flexdraft_jax.model import transformer


def sequential_step(target_params, cfg, drafter, state: DecodeState, *,
                    sp: SamplingParams, max_new, stop_ids,
                    attn_impl: str = "xla") -> DecodeState:
  """(1) the verify block through all layers; (2) one mask group, deep layers only."""
  bs = drafter.config.block_size
  block = jnp.concatenate([state.bonus_B[:, None], state.drafts_BxD], axis=1)
  pos = state.length_B[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
  h, _, cache = transformer.forward(target_params, cfg, state.cache, block, pos,
                                    attn_impl=attn_impl, kv_block=KV_BLOCK)
  y, a = verify.verify_block(target_params, cfg, h, state,
                             jnp.full_like(state.length_B, bs - 1), sp)
  new = verify.commit(state, y, a, cache, max_new=max_new, stop_ids=stop_ids)
  return verify.refresh_drafts(target_params, cfg, drafter, new, sp=sp,
                               attn_impl=attn_impl)
