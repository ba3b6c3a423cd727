"""Training data from regenerated records: the held-out split, the draft
vocabulary, anchors, and `Packer`, which makes fixed-shape batches whose order
and anchors depend only on (seed, step).

Flow: prompt_mix.load_prompts -> regenerate.py writes answered prompts as
shards -> regen_store.build_dataset -> regen_store.load_records -> `Packer`.
"""

from __future__ import annotations

import random
from typing import Iterable

import numpy as np

from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.training.prompt_mix import VARIANTS, stable_int
from flexdraft_jax.training.regen_store import Record


def question_uid(uid: str) -> str:
  """The uid of the question a record answers (a variant's without `#name`)."""
  return uid.partition("#")[0]


def split_eval(records: list, num_eval: int) -> tuple:
  """(train, eval): the held-out records are the `num_eval` answers to the mix's
  own prompts with the smallest uid hash — the same ones when variants or more
  questions' answers are added, unless those hash lower; answers to variants
  of a held-out question are in neither."""
  held = _held_questions(records, num_eval)
  return ([r for r in records if question_uid(r.uid) not in held],
          [r for r in records if r.uid in held])


def _held_questions(records: list, num_eval: int) -> set:
  own = sorted((r.uid for r in records if "#" not in r.uid),
               key=lambda uid: stable_int("eval:" + uid))
  return set(own[:num_eval])


def held_out_variants(records: list, num_eval: int) -> list:
  """The answers to prompt variants of `split_eval`'s held-out questions (in
  neither of its sets): the held-out questions in the benchmarks' formats."""
  held = _held_questions(records, num_eval)
  return [r for r in records if "#" in r.uid and question_uid(r.uid) in held]


def format_slices(records: list, source: str, num_eval: int, limit: int) -> dict:
  """{name: records} of one source (`launch/experiments/format_gap.py`): answers to the mix's
  own prompts and to the `#bench` variant that training sees (`limit` each, a
  fixed shuffle), and the held-out questions' answers in both formats
  (`split_eval`, `held_out_variants`)."""
  train, held = split_eval(records, num_eval)
  own = [r for r in train if r.source == source and "#" not in r.uid]
  bench = [r for r in train if r.source == source and r.uid.endswith("#bench")]
  for rs in (own, bench):
    random.Random(0).shuffle(rs)
  return {"own prompts, trained on": own[:limit], "#bench, trained on": bench[:limit],
          "own prompts, held out": [r for r in held if r.source == source],
          "#bench, held out": [r for r in held_out_variants(records, num_eval)
                               if r.source == source and r.uid.endswith("#bench")]}


def draft_vocabulary(records: list, size: int, vocab_size: int, always=()) -> np.ndarray:
  """The `size` most frequent answer tokens of `records` (SPEC §7), most frequent
  first (ties: lower id first); the ids in `always` (stop tokens) are kept in.
  With fewer distinct tokens than `size`, the rest are the lowest unused ids."""
  if size > vocab_size:
    raise FlexDraftError(f"draft_vocab={size} exceeds the target's vocabulary "
                         f"({vocab_size})")
  counts = np.zeros((vocab_size,), np.int64)
  for r in records:
    counts += np.bincount(r.answer_ids, minlength=vocab_size)[:vocab_size]
  always = [int(t) for t in always if 0 <= int(t) < vocab_size]
  counts[always] = np.iinfo(np.int64).max  # first, whatever their count
  order = np.lexsort((np.arange(vocab_size), -counts))
  return order[:size].astype(np.int32)


# --------------------------------------------------------------- packing ----

def anchor_range(prompt_len: int, length: int, seq_len: int, block_size: int) -> tuple:
  """(lo, hi), inclusive: the anchors a of a sequence (`length` real tokens
  within `seq_len`) with a >= prompt_len - 1 (the bonus at a + 1 is an answer
  token), a + block_size <= seq_len - 1 and a + 1 < length; none if hi < lo."""
  return max(prompt_len - 1, 0), min(seq_len - 1 - block_size, length - 2)


def without_anchor(records: list, seq_len: int, block_size: int) -> int:
  """How many of `records` have no anchor block that fits `seq_len`."""
  n = 0
  for r in records:
    length = min(len(r.prompt_ids) + len(r.answer_ids), seq_len)
    lo, hi = anchor_range(len(r.prompt_ids), length, seq_len, block_size)
    n += hi < lo
  return n


def check_anchors(records: list, seq_len: int, block_size: int) -> None:
  """Refuses training data where most sequences have no anchor that fits (they
  contribute nothing: loss and τ 0); says how many when some do not."""
  bad = without_anchor(records, seq_len, block_size)
  if not bad:
    return
  what = (f"{bad} of {len(records)} training sequences have no anchor block within "
          f"seq_len={seq_len} (their prompt leaves fewer than {block_size + 1} "
          "tokens for the answer)")
  if 2 * bad > len(records):
    raise FlexDraftError(f"{what}: raise --config.train.seq_len or lower "
                         "--config.data.max_prompt_tokens and regenerate")
  print(f"train: warning: {what}; they add nothing", flush=True)


class Packer:
  """Fixed-shape batches: sequences of `seq_len`, `anchors` anchor blocks each.

  Anchors a lie in the answer region (a >= prompt_len - 1, so the bonus at a+1
  is an answer token) with a + bs <= seq_len - 1 and a + 1 < length. With
  fewer candidates than anchors, anchors repeat; with none, the row has no
  valid anchor (weight 0).

  `width_multiple` > 0 cuts a batch without precomputed K/V to its longest
  sequence rounded up to that multiple (at most `seq_len`): the step's clean
  pass then costs the batch's tokens, not `seq_len` per row, for one compiled
  shape per width. Causal attention makes the cut padding irrelevant, and no
  anchor block reads past a sequence's end.
  """

  def __init__(self, records: list, *, seq_len: int, anchors: int, block_size: int,
               pad_id: int, seed: int, source_weights=None, variant_weights=None,
               width_multiple: int = 0, bonus_dropout: float = 0.0):
    if not records:
      raise FlexDraftError("no training records")
    self.records, self.seq_len, self.K = records, seq_len, anchors
    self.bs, self.pad_id, self.seed = block_size, pad_id, seed
    self.width_multiple = width_multiple
    # > 0: each anchor block is drawn blind (`blind_BxK`: its bonus input
    # dropped) with this probability; 1.0 scores parallel mode's drafting.
    self.bonus_dropout = bonus_dropout
    self.deep_kv = None  # optional (k, v) per record, [N, L, K, T, D] each
    # An epoch visits each record `source_weights[source]` times (default 1),
    # times `variant_weights[variant]` for an answer to a prompt variant.
    weights, by_variant = dict(source_weights or {}), dict(variant_weights or {})
    bad = {s: w for s, w in {**weights, **by_variant}.items()
           if not (isinstance(w, int) and w >= 0)}
    if bad:
      raise FlexDraftError(f"source weights must be integers >= 0, got {bad}")
    unknown = sorted(set(by_variant) - set(VARIANTS))
    if unknown:
      raise FlexDraftError(f"variant weights name no prompt variant: {unknown} (one of "
                           f"{', '.join(VARIANTS)})")
    self.pool = np.repeat(np.arange(len(records)), [
        weights.get(r.source, 1) * by_variant.get(r.uid.partition("#")[2], 1)
        for r in records])
    if not len(self.pool):
      raise FlexDraftError("source weights leave no training records")

  def tokens(self, rec: Record) -> tuple:
    """(tokens [T] padded/truncated, real length)."""
    ids = np.concatenate([rec.prompt_ids, rec.answer_ids])[:self.seq_len]
    tokens = np.full((self.seq_len,), self.pad_id, np.int32)
    tokens[:len(ids)] = ids
    return tokens, len(ids)

  def example(self, rec: Record, key: Iterable[int]) -> dict:
    T, bs, K = self.seq_len, self.bs, self.K
    tokens, length = self.tokens(rec)
    lo, hi = anchor_range(len(rec.prompt_ids), length, T, bs)
    rng = np.random.default_rng(list(key))
    if hi >= lo:
      cand = np.arange(lo, hi + 1)
      anchors = rng.choice(cand, K, replace=len(cand) < K)
      ok = np.ones((K,), bool)
    else:
      anchors, ok = np.zeros((K,), np.int64), np.zeros((K,), bool)
    out = {"tokens_BxT": tokens, "length_B": np.int32(length),
           "anchor_BxK": np.sort(anchors).astype(np.int32), "anchor_ok_BxK": ok}
    if self.bonus_dropout:
      out["blind_BxK"] = rng.random(K) < self.bonus_dropout
    return out

  def batch(self, indices, keys, width_of=None) -> dict:
    """Examples of records `indices`; a cut batch is as wide as the records
    `width_of` need (default: these; a process's share of a global batch
    passes the global batch's, so every process has one shape)."""
    rows = [self.example(self.records[i], k) for i, k in zip(indices, keys)]
    out = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    if self.deep_kv is not None:  # per layer, as loss.deep_kv_entries lays them out
      idx = np.asarray(indices)
      for c, kv in zip("kv", self.deep_kv):
        for l in range(kv.shape[1]):
          out[f"deep_{c}{l}"] = kv[idx, l]
    elif self.width_multiple:
      out["tokens_BxT"] = out["tokens_BxT"][:, :self.width(width_of or indices)]
    return out

  def width(self, indices) -> int:
    """The cut width of a batch of records `indices` (see `width_multiple`)."""
    longest = max(len(self.records[i].prompt_ids) + len(self.records[i].answer_ids)
                  for i in indices)
    m = self.width_multiple
    return min(self.seq_len, -(-longest // m) * m)

  def step_width(self, step: int, batch_size: int) -> int:
    """The width of training batch `step`: `seq_len` with precomputed K/V or
    without `width_multiple`, else its cut width (one compiled step each)."""
    if self.deep_kv is not None or not self.width_multiple:
      return self.seq_len
    return self.width(self.train_indices(step, batch_size)[0])

  def train_indices(self, step: int, batch_size: int) -> tuple:
    """Record indices and anchor keys of global rows of batch `step`: epoch-wise
    seeded permutations, so the order depends only on (seed, step)."""
    n = len(self.pool)
    idx, keys = [], []
    for g in range(step * batch_size, (step + 1) * batch_size):
      epoch, pos = divmod(g, n)
      perm = self._perm(epoch)
      idx.append(int(self.pool[perm[pos]]))
      keys.append((self.seed, 1, epoch, pos))
    return idx, keys

  def _perm(self, epoch: int):
    cache = getattr(self, "_perm_cache", None)
    if cache is None or cache[0] != epoch:
      perm = np.random.default_rng([self.seed, 0, epoch]).permutation(len(self.pool))
      self._perm_cache = cache = (epoch, perm)
    return cache[1]

  def train_batch(self, step: int, batch_size: int, rows=None) -> dict:
    """Batch `step` (rows = (start, stop) of the global batch for this process)."""
    idx, keys = self.train_indices(step, batch_size)
    every = idx
    if rows is not None:
      idx, keys = idx[rows[0]:rows[1]], keys[rows[0]:rows[1]]
    return self.batch(idx, keys, width_of=every)

  def eval_batches(self, batch_size: int, rows=None) -> list:
    """Fixed batches over every record (anchors from a fixed key), padded by
    repeating records whose anchors are then marked invalid."""
    n = len(self.records)
    out = []
    for start in range(0, n, batch_size):
      idx = [min(start + b, n - 1) for b in range(batch_size)]
      keys = [(self.seed, 2, i) for i in idx]
      real = np.array([start + b < n for b in range(batch_size)])
      every = idx
      if rows is not None:
        idx, keys, real = idx[rows[0]:rows[1]], keys[rows[0]:rows[1]], real[rows[0]:rows[1]]
      batch = self.batch(idx, keys, width_of=every)
      batch["anchor_ok_BxK"] &= real[:, None]
      out.append(batch)
    return out
