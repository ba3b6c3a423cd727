"""The device side of decoding: prefill, and the jitted chunk.

A *chunk* is one jitted `lax.while_loop` of up to `n` steps of one mode at one
verify length k, the state (and its KV cache) donated. The host (driver.py)
runs chunks and reads a few flags between them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flexdraft_jax.decoding import ar, kept_programs, parallel, sequential, tree, verify
from flexdraft_jax.decoding.options import Mode, SpecOptions
from flexdraft_jax.decoding.state import DecodeState, prefill
from flexdraft_jax.drafter.model import Drafter
from flexdraft_jax.model import pytree


def group_buckets(bs: int, opts: SpecOptions) -> tuple:
  """Group counts G (verify lengths k) that get a compiled step: 2, 3, 4, 8, 16 …
  capped at bs. Decoding's products pad more than 4 rows to a multiple of 8
  (`transformer.matmul_t`), so at batch 1 k = 5-7 costs what k = 8 does."""
  if opts.group_buckets:
    return tuple(sorted(opts.group_buckets))
  out, v = [g for g in (2, 3, 4) if g < bs], 8
  while v < bs:
    out.append(v)
    v *= 2
  out.append(bs)
  return tuple(sorted(set(out)))


_PREFILL_STATIC = ("cfg", "dcfg", "S", "sp", "out_len", "attn_impl", "cache_sharding",
                   "tree_top")
_CHUNK_STATIC = ("cfg", "dcfg", "mode", "num_groups", "sp", "strategy", "attn_impl",
                 "refresh", "tree_budget")


# Both programs are kept between processes traced (kept_programs.py) as well as
# compiled (compile_cache.py).
@kept_programs.kept(name="prefill_batch", static_argnames=_PREFILL_STATIC)
@functools.partial(jax.jit, static_argnames=_PREFILL_STATIC)
def prefill_batch(target_params, draft_params, prompt_BxP, plen_B, valid_B, key, *,
             cfg, dcfg, S, sp, max_new, out_len, stop_ids, attn_impl,
             cache_sharding=None, tree_top=0):
  B = prompt_BxP.shape[0]
  cache = pytree.KVCache.zeros(
      cfg, B, S, target_params["embed"].dtype,
      per_layer=pytree.is_per_layer(target_params))
  if cache_sharding is not None:
    cache = jax.lax.with_sharding_constraint(cache, cache_sharding)
  drafter = None if dcfg is None else Drafter(dcfg, draft_params)
  return prefill(target_params, cfg, cache, prompt_BxP, plen_B, valid_B, key,
                 sp=sp, max_new=max_new, out_len=out_len, stop_ids=stop_ids,
                 drafter=drafter, attn_impl=attn_impl, tree_top=tree_top)


@kept_programs.kept(name="run_chunk", static_argnames=_CHUNK_STATIC, donate_argnums=(2,))
@functools.partial(jax.jit, donate_argnames=("state",), static_argnames=_CHUNK_STATIC)
def run_chunk(target_params, draft_params, state: DecodeState, *, cfg, dcfg, mode,
              num_groups, n_steps, sp, max_new, stop_ids, theta, strategy,
              attn_impl, refresh=False, tree_budget=0):
  """Up to `n_steps` steps of one mode in a device loop (stops when all rows are
  done). `num_groups` is the verify length k: parallel's group count, or the
  positions of sequential's verify block. `tree_budget` > 0: sequential steps
  verify a draft tree of that many nodes instead (tree.py)."""
  drafter = None if dcfg is None else Drafter(dcfg, draft_params)
  kw = dict(sp=sp, max_new=max_new, stop_ids=stop_ids, attn_impl=attn_impl)
  if refresh:  # drafts went stale during AR steps
    state = verify.refresh_drafts(target_params, cfg, drafter, state, sp=sp,
                                  attn_impl=attn_impl)
  if mode == Mode.AR:
    step = lambda st: ar.ar_step(target_params, cfg, st, **kw)
  elif mode == Mode.SEQUENTIAL and tree_budget:
    step = lambda st: tree.tree_step(target_params, cfg, drafter, st, budget=tree_budget,
                                     **kw)
  elif mode == Mode.SEQUENTIAL:
    step = lambda st: sequential.sequential_step(
        target_params, cfg, drafter, st, verify_len=num_groups, theta=theta,
        strategy=strategy, **kw)
  else:
    step = lambda st: parallel.parallel_step(
        target_params, cfg, drafter, st, num_groups=num_groups, theta=theta,
        strategy=strategy, **kw)

  def cond(carry):
    i, st = carry
    return (i < n_steps) & ~jnp.all(st.done_B)

  def body(carry):
    i, st = carry
    return i + 1, step(st)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "budget"))
def tree_mass(target_params, draft_params, state: DecodeState, *, cfg, dcfg, budget):
  """Each row's draft tree of `budget` nodes: its nodes' path probabilities
  under the draft, best first `[B, budget - 1]` (`tree.path_probs`)."""
  return tree.path_probs(cfg, Drafter(dcfg, draft_params), state, budget)


@functools.partial(jax.jit, static_argnames=("strategy",))
def needed_groups(state: DecodeState, *, theta, strategy):
  """(the verify length selective verification asks for, live rows)."""
  vlen = verify.selective_vlen(state.conf_BxD, theta, strategy)
  return jnp.max(jnp.where(state.done_B, 1, vlen)) + 1, jnp.sum(~state.done_B)


def verify_buckets(bs: int, opts: SpecOptions) -> tuple:
  """(k_max, the verify lengths k that get a compiled step, up to k_max)."""
  k_max = min(opts.verify_len or bs, bs)
  return k_max, tuple(sorted({g for g in group_buckets(bs, opts) if g <= k_max} | {k_max}))


@jax.jit
def take_rows(state, idx_R):
  """The state of rows `idx_R` only (per-layer cache arrays are `[B, K, S, D]`)."""
  batch = lambda x: jnp.take(x, idx_R, axis=0)
  return state._replace(
      cache=jax.tree.map(batch, state.cache),
      length_B=batch(state.length_B), bonus_B=batch(state.bonus_B),
      drafts_BxD=batch(state.drafts_BxD), conf_BxD=batch(state.conf_BxD),
      q_BxDxV=batch(state.q_BxDxV), cand_BxDxC=batch(state.cand_BxDxC),
      cand_lp_BxDxC=batch(state.cand_lp_BxDxC), out_BxO=batch(state.out_BxO),
      n_out_B=batch(state.n_out_B), done_B=batch(state.done_B),
      hist_BxL=batch(state.hist_BxL))
