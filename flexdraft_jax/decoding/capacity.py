"""A request's shapes: the KV-cache length and the prompt padding. Each distinct
shape is a program to compile (or load), so short requests share one cache
length and prompts are padded to a multiple; a request the model's context or
`runtime.max_len` cannot hold is an error here, never silently enlarged."""

from __future__ import annotations

from flexdraft_jax.decoding.state import KV_BLOCK
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.util import round_up


def spare_positions(bs: int, tree_budget=None) -> int:
  """Cache slots a request needs past its last token: two draft blocks, or a
  draft tree's nodes where that is more."""
  return max(2 * bs, tree_budget or 0) + 1


# Each cache length and padded prompt length is a program to compile (or load):
# requests up to MIN_CACHE_LEN positions share that one length (the attention
# over the extra empty slots is a small part of a step), and prompts are padded
# to a multiple of PROMPT_PAD.
MIN_CACHE_LEN = 2 * KV_BLOCK
PROMPT_PAD = 64


def cache_length(cfg, plens, max_new, bs, max_len, tree_budget=0):
  """The KV-cache length: `max_len` (rounded up to KV_BLOCK) or what the
  request needs. The model's context bounds prompt + new tokens either way; a
  `max_len` too short for the request is an error, never silently enlarged."""
  longest = max(plens)
  spare = spare_positions(bs, tree_budget)
  need = longest + max_new + spare
  if max_len is not None and longest + 1 > max_len:
    raise FlexDraftError(f"a prompt has {longest} tokens, longer than the cache "
                         f"(runtime.max_len={max_len})")
  if longest + max_new > cfg.max_position_embeddings:
    raise FlexDraftError(
        f"prompt of {longest} tokens + max_new_tokens={max_new} exceeds the "
        f"model's context of {cfg.max_position_embeddings}")
  if max_len is None:  # short requests share one length: one set of programs
    most = round_up(cfg.max_position_embeddings + spare, KV_BLOCK)
    return max(round_up(need, KV_BLOCK), min(MIN_CACHE_LEN, most))
  if max_len < need:
    raise FlexDraftError(
        f"runtime.max_len={max_len} is too short: a prompt of {longest} tokens + max_new_tokens="
        f"{max_new} needs {need} (with {spare} spare positions for the decode "
        "steps); raise it, or leave it unset")
  most = round_up(cfg.max_position_embeddings + spare, KV_BLOCK)
  if max_len > most:  # positions past the context are never written: memory for nothing
    raise FlexDraftError(
        f"runtime.max_len={max_len} is beyond the model's context of "
        f"{cfg.max_position_embeddings} (a cache of {most} holds every request): "
        "lower it, or leave it unset")
  return round_up(max_len, KV_BLOCK)
