"""Parallel mode: verify the block and draft every possible branch in one forward."""

from __future__ import annotations

import jax.numpy as jnp

from flexdraft_jax.decoding import verify
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.decoding.state import KV_BLOCK, DecodeState, mask_block
from flexdraft_jax.model import transformer


def parallel_step(target_params, cfg, drafter, state: DecodeState, *,
                  num_groups: int, sp: SamplingParams, max_new: int,
                  stop_ids: tuple, theta, strategy: str,
                  attn_impl: str = "xla") -> DecodeState:
  """Verify block `[b, d1..]` plus `num_groups` mask groups (SPEC §2).

  Group g is the draft for "g drafts accepted"; at most `num_groups - 1`
  drafts are verified (fewer where selective verification prunes), so the
  verify block is `[b, d1 .. d_{G-1}]`: G positions.
  """
  bs, L = drafter.config.block_size, drafter.config.num_layers
  B, c = state.length_B.shape[0], state.length_B
  block = jnp.concatenate([state.bonus_B[:, None], state.drafts_BxD[:, :num_groups - 1]],
                          axis=1)
  pos = c[:, None] + jnp.arange(num_groups, dtype=jnp.int32)[None]
  masks = mask_block(c + 1, c, num_groups, bs)
  h, hm, cache = transformer.Transformer.of(cfg, target_params).apply(
      transformer.variables(target_params, drafter.params), state.cache, block, pos,
      masks=masks, num_draft_layers=L, attn_impl=attn_impl, kv_block=KV_BLOCK,
      method="forward")
  vlen = jnp.minimum(verify.selective_vlen(state.conf_BxD, theta, strategy),
                     num_groups - 1)
  y, a = verify.verify_block(target_params, cfg, h, state, vlen, sp)
  new = verify.commit(state, y, a, cache, max_new=max_new, stop_ids=stop_ids)
  hm_group = jnp.take_along_axis(
      hm.reshape(B, num_groups, bs, -1), a[:, None, None, None], axis=1)[:, 0]
  return verify.set_drafts(target_params, cfg, drafter, new, hm_group, state, sp)
