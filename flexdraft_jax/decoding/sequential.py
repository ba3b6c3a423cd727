"""Sequential mode: verify, then draft one branch that reuses the KV cache."""

from __future__ import annotations

import jax.numpy as jnp

from flexdraft_jax.decoding import verify
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.decoding.state import KV_BLOCK, DecodeState
from flexdraft_jax.model import transformer


def sequential_step(target_params, cfg, drafter, state: DecodeState, *,
                    sp: SamplingParams, max_new, stop_ids, verify_len: int = 0,
                    theta=0.0, strategy: str = "cumulative_product",
                    attn_impl: str = "xla") -> DecodeState:
  """(1) the verify block `[b, d1 .. d_{k-1}]` through all layers (k =
  `verify_len`, the drafter's block size when 0); (2) one mask group of the
  full block, deep layers only. With θ > 0 the confidence rule may verify
  fewer than k - 1 drafts (SPEC §7)."""
  k = verify_len or drafter.config.block_size
  block = jnp.concatenate([state.bonus_B[:, None], state.drafts_BxD[:, :k - 1]], axis=1)
  pos = state.length_B[:, None] + jnp.arange(k, dtype=jnp.int32)[None]
  h, _, cache = transformer.Transformer.of(cfg, target_params).apply(
      transformer.variables(target_params), state.cache, block, pos,
      attn_impl=attn_impl, kv_block=KV_BLOCK, method="forward")
  vlen = jnp.minimum(verify.selective_vlen(state.conf_BxD, theta, strategy), k - 1)
  y, a = verify.verify_block(target_params, cfg, h, state, vlen, sp)
  new = verify.commit(state, y, a, cache, max_new=max_new, stop_ids=stop_ids)
  return verify.refresh_drafts(target_params, cfg, drafter, new, sp=sp,
                               attn_impl=attn_impl)
