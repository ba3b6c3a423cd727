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


class PromptDoesNotFit(FlexDraftError):
  """A prompt the request cannot hold. `index` is its place among the call's
  prompts; the message names it as `prompt INDEX`, and `named(name)` gives the
  message naming it otherwise (the command line names a file's line)."""

  def __init__(self, template: str, index: int):
    self.template, self.index = template, index
    super().__init__(self.named(f"prompt {index}"))

  def named(self, name: str) -> str:
    return self.template.replace("{prompt}", name)


def check_request(cfg, plens, max_new, bs, max_len, tree_budget=0) -> None:
  """Every prompt of a call (`plens`: their lengths) against the model's context
  and `max_len`, before any is decoded: a prompt that does not fit is an error
  (PromptDoesNotFit, naming it) however many prompts come before it."""
  spare = spare_positions(bs, tree_budget)
  for i, n in enumerate(plens):
    if n + max_new > cfg.max_position_embeddings:
      raise PromptDoesNotFit(
          f"{{prompt}} ({n} tokens) + max_new_tokens={max_new} exceeds the model's "
          f"context of {cfg.max_position_embeddings}", i)
  if max_len is None:
    return
  longest = max(plens)
  i = list(plens).index(longest)  # the cache must hold the longest
  if longest + 1 > max_len:
    raise PromptDoesNotFit(f"{{prompt}} has {longest} tokens, longer than the cache "
                           f"(runtime.max_len={max_len})", i)
  need = longest + max_new + spare
  if max_len < need:
    raise PromptDoesNotFit(
        f"runtime.max_len={max_len} is too short: {{prompt}} ({longest} tokens) + "
        f"max_new_tokens={max_new} needs {need} (with {spare} spare positions for the "
        "decode steps); raise it, or leave it unset", i)
  most = round_up(cfg.max_position_embeddings + spare, KV_BLOCK)
  if max_len > most:  # positions past the context are never written: memory for nothing
    raise FlexDraftError(
        f"runtime.max_len={max_len} is beyond the model's context of "
        f"{cfg.max_position_embeddings} (a cache of {most} holds every request): "
        "lower it, or leave it unset")


def cache_length(cfg, plens, max_new, bs, max_len, tree_budget=0):
  """The KV-cache length: `max_len` (rounded up to KV_BLOCK) or what the
  request needs (a request `check_request` has passed: it fits)."""
  if max_len is not None:
    return round_up(max_len, KV_BLOCK)
  spare = spare_positions(bs, tree_budget)
  need = max(plens) + max_new + spare
  # short requests share one length: one set of programs
  most = round_up(cfg.max_position_embeddings + spare, KV_BLOCK)
  return max(round_up(need, KV_BLOCK), min(MIN_CACHE_LEN, most))
