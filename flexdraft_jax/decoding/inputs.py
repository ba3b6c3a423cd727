"""What `generate`'s inputs become before anything is compiled or run: prompt
ids (tokenised, checked against the vocabulary), the stop ids, the drafters
checked for the mode (block size, verify length, calibration, a pair's shared
draft vocabulary), the draft tree's width, and each batch's PRNG key. Each check
raises its one-line `FlexDraftError` here, before the first batch starts."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax.decoding.options import Mode, SpecOptions, check_stop, python_name
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.drafter.model import Drafter
from flexdraft_jax.model.config import FlexDraftError, FlexDraftWarning


def encode_prompts(target, prompts, chat: bool):
  """Each prompt as token ids: text encoded (through the chat template with
  `chat`), ids checked against the vocabulary; an empty prompt is BOS alone."""
  tok = target.tokenizer
  ids = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      x = tok.apply_chat_template(p) if chat else tok.encode(p)
    else:
      x = [int(t) for t in p]
      bad = [t for t in x if not 0 <= t < target.config.vocab_size]
      if bad:
        raise FlexDraftError(f"prompt {i} has token id {bad[0]} outside the "
                             f"vocabulary [0, {target.config.vocab_size})")
    if not x:
      bos = target.config.bos_token_id
      if bos is None:
        raise FlexDraftError(f"prompt {i} is empty and the model has no BOS token")
      x = [bos]  # an empty prompt is generated from BOS
    ids.append(list(x))
  return ids


MAX_STOP_IDS = 8


def stop_array(stop_ids: tuple) -> jax.Array:
  """`stop_ids` padded with -1 to MAX_STOP_IDS: one traced shape for any stop list."""
  return jnp.asarray(list(stop_ids) + [-1] * (MAX_STOP_IDS - len(stop_ids)), jnp.int32)


def stop_ids(target, stop) -> tuple:
  """The stop tokens, sorted and unique: `stop`'s ids and single-token strings,
  or the model's EOS ids without it."""
  check_stop(stop)
  vocab = target.config.vocab_size
  if stop is None:
    ids = tuple(target.config.eos_token_ids)
  else:
    ids = []
    for s in stop:
      if isinstance(s, str):
        if target.tokenizer is None:
          raise FlexDraftError(f"stop string {s!r} needs a tokenizer and {target.name} "
                               "has none: pass the stop token's id")
        enc = target.tokenizer.encode(s)
        if len(enc) != 1:
          raise FlexDraftError(f"stop string {s!r} is not a single token")
        s = enc[0]
      if not 0 <= int(s) < vocab:
        raise FlexDraftError(f"stop id {int(s)} is outside the vocabulary [0, {vocab})")
      ids.append(int(s))
    ids = tuple(ids)
  ids = tuple(sorted(set(ids)))
  if len(ids) > MAX_STOP_IDS:
    raise FlexDraftError(f"at most {MAX_STOP_IDS} stop tokens, got {len(ids)}")
  return ids


def seed_key(seed: int, offset: int = 0) -> jax.Array:
  """The PRNG key of `seed + offset`, from all 64 bits of that sum (modulo
  2**64: no seed overflows). For 0 <= seed + offset < 2**32 it is
  `jax.random.PRNGKey(seed + offset)`, the key decoding has always drawn
  from; beyond, `PRNGKey` (without 64-bit ints) would keep only the low 32
  bits, and seeds 5 and 2**32 + 5 would draw alike."""
  u = (int(seed) + offset) % 2 ** 64
  if jax.config.jax_default_prng_impl != "threefry2x32":  # keys of another layout
    key = jax.random.PRNGKey(u & 0xFFFFFFFF)
    return jax.random.fold_in(key, u >> 32) if u >> 32 else key
  return jnp.asarray(np.array([u >> 32, u & 0xFFFFFFFF], np.uint32))  # PRNGKey's layout


def speculative_drafter(drafter: Drafter, target, mode: Mode, so: SpecOptions,
                         warn_blind: bool = True) -> Drafter:
  """`drafter` checked against `target` and `mode`, with `so`'s block size and
  calibration."""
  from flexdraft_jax.drafter.compat import check_compatible
  check_compatible(drafter, target)
  if warn_blind and mode == Mode.PARALLEL and not drafter.config.drafts_blind:
    warnings.warn("mode 'parallel' drafts before the bonus is known and this drafter "
                  "was trained to read it (bonus_input without bonus_dropout): it "
                  "drafts blind, poorly; 'sequential' or 'flex' suit it",
                  FlexDraftWarning, stacklevel=3)
  drafter = _with_block_size(drafter, so.block_size)
  if so.verify_len is not None and so.verify_len > drafter.config.block_size:
    raise FlexDraftError(f"{python_name('verify_len')}={so.verify_len} exceeds the "
                         f"block size {drafter.config.block_size}")
  if not so.calibrate:  # ablation: drafts without the bonus-guided calibration
    drafter = drafter._replace(config=dataclasses.replace(drafter.config, calibrate=False))
  return drafter


def tree_top(drafter: Optional[Drafter], mode: Mode, so: SpecOptions,
              sp: SamplingParams, vocab_size: int) -> int:
  """Candidates kept per draft slot for draft trees (`speculation.tree_budget`;
  0 without): the drafter's `rescore_top`, the candidates its n-gram prior
  re-scores. Checks the budget against what the drafter can fill."""
  if so.tree_budget is None or drafter is None:
    return 0
  if mode not in (Mode.SEQUENTIAL, Mode.FLEX):
    raise FlexDraftError(f"{python_name('tree_budget')} runs in mode 'sequential' or "
                         f"'flex' (draft trees verify, then draft), not {str(mode)!r}")
  if sp.draft_sampling and not sp.greedy:
    raise FlexDraftError(f"{python_name('tree_budget')} verifies the likeliest drafts "
                         f"(each node a point-mass draft): turn "
                         f"{python_name('draft_sampling')} off")
  dcfg = drafter.config
  top = min(dcfg.rescore_top, dcfg.draft_vocab or vocab_size)
  # the root, and every path of 1 .. block - 1 candidates
  most = 1 + sum(top ** d for d in range(1, dcfg.block_size))
  if so.tree_budget > most:
    raise FlexDraftError(f"{python_name('tree_budget')}={so.tree_budget} exceeds the "
                         f"{most} nodes this drafter's block can fill (block "
                         f"{dcfg.block_size}, {top} candidates a slot)")
  return top


def check_drafter_pair(drafter: Drafter, parallel_drafter: Drafter):
  """The drafts in flight pass between the two drafters as flex switches modes
  (and at T > 0 with their draft distributions): one block size, one draft
  vocabulary."""
  a, b = drafter.config, parallel_drafter.config
  if a.block_size != b.block_size:
    raise FlexDraftError(f"the parallel drafter's block size {b.block_size} differs from "
                         f"the drafter's {a.block_size}: they must match")
  va, vb = drafter.params.get("vocab"), parallel_drafter.params.get("vocab")
  same = (va is None and vb is None) or (
      va is not None and vb is not None and va.shape == vb.shape
      and bool(np.array_equal(np.asarray(va), np.asarray(vb))))
  if not same:
    raise FlexDraftError("the parallel drafter's draft vocabulary differs from the "
                         "drafter's: they must draft over the same token ids")
  if not b.drafts_blind:
    warnings.warn("the parallel drafter was trained to read the bonus (bonus_input "
                  "without bonus_dropout): parallel mode drafts before the bonus is "
                  "known, so it drafts blind, poorly", FlexDraftWarning, stacklevel=4)


def _with_block_size(drafter: Drafter, block_size: Optional[int]) -> Drafter:
  """A drafter may decode with a smaller block than it was trained with."""
  trained = drafter.config.block_size
  if block_size is None or block_size == trained:
    return drafter
  if not 2 <= block_size <= trained:
    raise FlexDraftError(f"block size {block_size} is not supported by this drafter "
                         f"(trained with {trained}; use 2..{trained})")
  return drafter._replace(config=dataclasses.replace(drafter.config, block_size=block_size))
