"""Training data: prompt sources, the regenerated tfds dataset, packing, batch order.

Flow: `load_prompts` (GSM8K train, MBPP 511–974, Arena-Hard, questions the
target wrote (self_instruct.py); never eval sets) -> regenerate.py writes
answered prompts as JSONL shards -> `build_dataset` turns the shards into a
tfds dataset (array_record) -> `load_records` reads it back through
`as_data_source` -> `Packer` makes fixed-shape batches whose order and anchors
depend only on (seed, step).
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import hashlib
import json
import os
import random
import shutil
from typing import Iterable, NamedTuple

import numpy as np
import tensorflow_datasets as tfds

from flexdraft_jax.evaluation.benchmarks import (CODE_INSTRUCTION, MATH_INSTRUCTION,
                                                 complete_function)
from flexdraft_jax.model.config import FlexDraftError

DATASET_NAME = "flexdraft_regen"
SOURCES = ("gsm8k", "mbpp", "arena_hard_v01", "arena_hard_v20", "self_instruct")


class Prompt(NamedTuple):
  uid: str      # "<source>:<id>", stable across runs
  source: str
  text: str


def _jsonl(path: str) -> list:
  if not os.path.isfile(path):
    raise FlexDraftError(f"prompt file not found: {path}")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


# Prompt variants: the same training questions framed another way, whose
# greedy answers are new training text. A variant's uid is "<source>:<id>#<name>";
# it stays with its question: held out with it, never in the held-out set
# (`split_eval`). Each maps the sources it frames to the suffix it ends with.
VARIANTS = {
    # The benchmarks' own instructions (evaluation.benchmarks) on training questions.
    "bench": {"gsm8k": MATH_INSTRUCTION, "mbpp": CODE_INSTRUCTION},
    # MBPP tasks framed as HumanEval frames a prompt: a function to complete.
    "fn": {"mbpp": ""},
    # The same, with every test as a HumanEval-style example (call, then its value).
    "doc": {"mbpp": ""},
}


def read_source(source: str, path: str, suffix: str = "", variant: str = "") -> list:
  """All prompts of one source (training splits only), or of its `variant`
  (none when the variant does not frame this source)."""
  if variant:
    if variant not in VARIANTS:
      raise FlexDraftError(f"unknown prompt variant {variant!r} (known: "
                           f"{', '.join(VARIANTS)})")
    if source not in VARIANTS[variant]:
      return []
    suffix = VARIANTS[variant][source]
  if source == "gsm8k":
    rows = [Prompt(f"gsm8k:{i}", source, r["question"]) for i, r in enumerate(_jsonl(path))]
  elif source == "mbpp":
    # MBPP validation (511-600) + train (601-974); 1-510 are test/few-shot.
    tasks = [r for r in _jsonl(path) if 511 <= int(r["task_id"]) <= 974]
    if variant in ("fn", "doc"):
      rows = [Prompt(f"mbpp:{r['task_id']}", source, complete_function(code))
              for r in tasks if (code := mbpp_function(r, examples=variant == "doc"))]
    else:
      rows = [Prompt(f"mbpp:{r['task_id']}", source,
                     f"{r['text']}\nYour code should pass this test:\n{r['test_list'][0]}")
              for r in tasks]
  elif source.startswith("arena_hard"):
    rows = [Prompt(f"{source}:{r['uid']}", source, r["prompt"]) for r in _jsonl(path)]
  elif source == "self_instruct":  # uids are "self_instruct:SEED-CANDIDATE" already
    if not os.path.isfile(path):
      raise FlexDraftError(f"no self-instruct questions at {path}: make them first with "
                           "python -m flexdraft_jax self-instruct --config CONFIG --num=N")
    rows = [Prompt(r["uid"], source, r["question"]) for r in _jsonl(path)]
  else:
    raise FlexDraftError(f"unknown prompt source {source!r} (known: {', '.join(SOURCES)})")
  if suffix:
    rows = [p._replace(text=p.text + suffix) for p in rows]
  if variant:
    rows = [p._replace(uid=f"{p.uid}#{variant}") for p in rows]
  return rows


def mbpp_function(task: dict, examples: bool = False) -> str:
  """An MBPP task as a function to complete: the reference code's imports and
  the signature of the function its first test calls, with the task and that
  test as the docstring ("" when the code defines no such function on one line).
  With `examples`, the docstring shows every `assert CALL == VALUE` test as
  HumanEval shows one: `>>> CALL`, then `VALUE`."""
  test = task["test_list"][0]
  lines = [l.rstrip() for l in task["code"].replace("\r\n", "\n").split("\n")]
  imports = [l for l in lines if l.startswith(("import ", "from "))]
  for line in lines:
    name = line[4:].partition("(")[0].strip() if line.startswith("def ") else ""
    if name and f"{name}(" in test and line.endswith(":"):
      if examples:
        shown = [f"    >>> {call}\n    {value}"
                 for call, value in filter(None, map(_call_and_value, task["test_list"]))]
      else:
        shown = [f"    >>> {test.removeprefix('assert ').strip()}\n    True"]
      doc = "\n".join([f'    """{task["text"].strip()}', *shown, '    """'])
      return "\n".join(imports + [line, doc])
  return ""


def _call_and_value(test: str):
  """(CALL, VALUE) source text of `assert CALL == VALUE`, else None."""
  try:
    node = ast.parse(test.strip()).body[0]
  except (SyntaxError, IndexError):
    return None
  if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)
          and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)):
    return None
  source = test.strip()
  return (ast.get_source_segment(source, node.test.left),
          ast.get_source_segment(source, node.test.comparators[0]))


def load_prompts(data_cfg) -> list:
  """The prompt mix: `data_cfg.mix[source]` prompts of each source (-1: all),
  picked by a seeded shuffle, interleaved round-robin; `data_cfg.variant` frames
  them as that variant does (sources it does not frame are left out)."""
  picked = []
  variant = data_cfg.variant
  for source, count in sorted(dict(data_cfg.mix).items()):
    if count == 0:
      continue
    rows = read_source(source, data_cfg.paths[source],
                       dict(data_cfg.suffix).get(source, ""), variant)
    order = np.random.default_rng([data_cfg.seed, stable_int(source)]).permutation(len(rows))
    picked.append([rows[i] for i in order[:None if count < 0 else count]])
  out = []
  for i in range(max((len(p) for p in picked), default=0)):
    out += [p[i] for p in picked if i < len(p)]
  return out


def stable_int(s: str) -> int:
  return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16)


# ---------------------------------------------------------------- shards ----

def shard_dir(regen_dir: str) -> str:
  return os.path.join(regen_dir, "shards")


def write_shard(regen_dir: str, index: int, records: list) -> str:
  """Atomically writes answered prompts as shard `index` (JSON lines)."""
  d = shard_dir(regen_dir)
  os.makedirs(d, exist_ok=True)
  path = os.path.join(d, f"shard-{index:05d}.jsonl")
  with open(path + ".tmp", "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  os.replace(path + ".tmp", path)
  return path


def next_shard_index(regen_dir: str) -> int:
  paths = glob.glob(os.path.join(shard_dir(regen_dir), "shard-*.jsonl"))
  return 1 + max((int(os.path.basename(p)[6:11]) for p in paths), default=-1)


def read_shards(regen_dir: str) -> list:
  out = []
  for path in sorted(glob.glob(os.path.join(shard_dir(regen_dir), "shard-*.jsonl"))):
    with open(path) as f:
      out += [json.loads(line) for line in f if line.strip()]
  return out


# ------------------------------------------------------------------ tfds ----

class FlexdraftRegen(tfds.core.GeneratorBasedBuilder):
  """Target-regenerated answers: prompt ids (chat template) + answer ids."""
  VERSION = tfds.core.Version("1.0.0")

  def __init__(self, *, shards_from: str = "", **kwargs):
    self._shards_from = shards_from
    super().__init__(**kwargs)

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self, description=self.__doc__,
        features=tfds.features.FeaturesDict({
            "uid": tfds.features.Text(),
            "source": tfds.features.Text(),
            "prompt_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
            "answer_ids": tfds.features.Tensor(shape=(None,), dtype=np.int32),
        }))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for r in read_shards(self._shards_from):
      yield r["uid"], {"uid": r["uid"], "source": r["source"],
                       "prompt_ids": np.asarray(r["prompt_ids"], np.int32),
                       "answer_ids": np.asarray(r["answer_ids"], np.int32)}


def tfds_dir(regen_dir: str) -> str:
  return os.path.join(regen_dir, "tfds")


def build_dataset(regen_dir: str) -> str:
  """(Re)builds the tfds dataset (array_record) from the shards; returns its dir."""
  if not read_shards(regen_dir):
    raise FlexDraftError(f"no regenerated shards in {shard_dir(regen_dir)}")
  root = tfds_dir(regen_dir)
  shutil.rmtree(root, ignore_errors=True)
  builder = FlexdraftRegen(shards_from=regen_dir, data_dir=root,
                           file_format="array_record")
  tfds.disable_progress_bar()
  builder.download_and_prepare()
  return builder.data_path.__fspath__()


# ---------------------------------------------------------------- packed ----
# A regenerated dataset in one compressed file that can live in a repository:
# every record's prompt + answer ids back to back (uint16 where the vocabulary
# allows), with lengths, uids, sources and stop flags; meta.json alongside.

def pack_regen(regen_dir: str, path: str) -> dict:
  """Writes the shards of `regen_dir` to the compressed `path` (.npz); returns
  counts for the dataset card."""
  recs = sorted(read_shards(regen_dir), key=lambda r: r["uid"])
  if not recs:
    raise FlexDraftError(f"no regenerated shards in {shard_dir(regen_dir)}")
  ids = np.concatenate([np.asarray(r["prompt_ids"] + r["answer_ids"], np.int64)
                        for r in recs])
  dtype = np.uint16 if ids.max() < 2 ** 16 else np.int32
  with open(os.path.join(regen_dir, "meta.json")) as f:
    meta = json.load(f)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp.npz"
  np.savez_compressed(
      tmp, ids=ids.astype(dtype),
      prompt_len=np.array([len(r["prompt_ids"]) for r in recs], np.int32),
      answer_len=np.array([len(r["answer_ids"]) for r in recs], np.int32),
      uid=np.array([r["uid"] for r in recs]), source=np.array([r["source"] for r in recs]),
      stopped=np.array([bool(r.get("stopped")) for r in recs]),
      meta=np.array(json.dumps(meta)))
  os.replace(tmp, path)
  return {"records": len(recs), "answer_tokens": int(sum(len(r["answer_ids"]) for r in recs)),
          "bytes": os.path.getsize(path)}


def use_packed(data_cfg) -> None:
  """Unpacks `data_cfg.packed` (if set) into `data_cfg.regen_dir`, adding the
  records it does not hold yet, so training and regeneration start from it."""
  packed = data_cfg.packed
  if packed:
    added = unpack_regen(packed, os.path.abspath(data_cfg.regen_dir))
    if added:
      print(f"data: {added} regenerated answers from {packed} -> {data_cfg.regen_dir}",
            flush=True)


def unpack_regen(path: str, regen_dir: str) -> int:
  """Writes a packed dataset into `regen_dir` as one shard + meta.json (answers
  already there are kept, so `regenerate` continues from both) and rebuilds the
  tfds dataset; returns the number of records added."""
  if not os.path.isfile(path):
    raise FlexDraftError(f"no packed regenerated dataset at {path}")
  with np.load(path) as z:
    ids, plen, alen = z["ids"].astype(np.int64), z["prompt_len"], z["answer_len"]
    uids, sources, stopped = z["uid"], z["source"], z["stopped"]
    meta = json.loads(str(z["meta"]))
  meta_path = os.path.join(regen_dir, "meta.json")
  if os.path.exists(meta_path):
    with open(meta_path) as f:
      old = json.load(f)
    if old.get("target_fingerprint") != meta.get("target_fingerprint"):
      raise FlexDraftError(f"{regen_dir} holds answers of target "
                           f"{old.get('target_fingerprint')}, {path} of "
                           f"{meta.get('target_fingerprint')}")
  else:
    os.makedirs(regen_dir, exist_ok=True)
    with open(meta_path, "w") as f:
      json.dump(meta, f, indent=1)
  done = {r["uid"] for r in read_shards(regen_dir)}
  ends = np.cumsum(plen + alen)
  out = []
  for i, end in enumerate(ends):
    if str(uids[i]) in done:
      continue
    start = end - plen[i] - alen[i]
    out.append({"uid": str(uids[i]), "source": str(sources[i]),
                "prompt_ids": ids[start:start + plen[i]].tolist(),
                "answer_ids": ids[start + plen[i]:end].tolist(),
                "stopped": bool(stopped[i])})
  if out:
    write_shard(regen_dir, next_shard_index(regen_dir), out)
  if out or not glob.glob(os.path.join(tfds_dir(regen_dir), DATASET_NAME, "*")):
    build_dataset(regen_dir)
  return len(out)


# What answers in one regen dir must share: the target and how it answered.
REGEN_SETTINGS = ("target_fingerprint", "max_new_tokens", "chat_kwargs")


def check_made_by(regen_dir: str, target) -> None:
  """Refuses (one line) to train on answers another target regenerated: the
  drafter would learn to predict a model it never serves. Data without a
  meta.json is not checked."""
  path = os.path.join(regen_dir, "meta.json")
  if not os.path.isfile(path):
    return
  with open(path) as f:
    meta = json.load(f)
  made = meta.get("target_fingerprint")
  if made is not None and made != target.fingerprint:
    raise FlexDraftError(
        f"{regen_dir} holds answers regenerated by {meta.get('target', 'another target')}, "
        f"not by {target.name} (another fingerprint): regenerate with this target into "
        "another --config.data.regen_dir, or train the target that made them")


def merge_regen(dst_dir: str, src_dir: str) -> int:
  """Adds the answers of `src_dir` that `dst_dir` lacks, as one new shard (e.g.
  the parts of a regeneration split with `data.part`), and rebuilds the tfds
  dataset; both must hold the same target's answers with the same settings.
  Returns the number of records added."""
  metas = []
  for d in (dst_dir, src_dir):
    path = os.path.join(d, "meta.json")
    if not os.path.isfile(path):
      raise FlexDraftError(f"no regenerated answers in {d} (no meta.json)")
    with open(path) as f:
      metas.append(json.load(f))
  for key in REGEN_SETTINGS:
    if metas[0].get(key) != metas[1].get(key):
      raise FlexDraftError(f"cannot merge {src_dir} into {dst_dir}: {key} "
                           f"{metas[1].get(key)!r} vs {metas[0].get(key)!r}")
  done = {r["uid"] for r in read_shards(dst_dir)}
  new = [r for r in read_shards(src_dir) if r["uid"] not in done]
  new = list({r["uid"]: r for r in new}.values())
  if new:
    write_shard(dst_dir, next_shard_index(dst_dir), new)
    build_dataset(dst_dir)
  return len(new)


@dataclasses.dataclass
class Record:
  uid: str
  source: str
  prompt_ids: np.ndarray
  answer_ids: np.ndarray


def load_records(regen_dir: str) -> list:
  """Every record of the tfds dataset in `regen_dir`, sorted by uid."""
  version_dirs = sorted(glob.glob(os.path.join(tfds_dir(regen_dir), DATASET_NAME, "*")))
  if not version_dirs:
    raise FlexDraftError(f"no regenerated dataset in {regen_dir} (run "
                         "`python -m flexdraft_jax regenerate` first)")
  source = tfds.builder_from_directory(version_dirs[-1]).as_data_source()["train"]
  out = []
  for i in range(len(source)):
    ex = source[i]
    out.append(Record(_text(ex["uid"]), _text(ex["source"]),
                      np.asarray(ex["prompt_ids"], np.int32),
                      np.asarray(ex["answer_ids"], np.int32)))
  return sorted(out, key=lambda r: r.uid)


def _text(x) -> str:
  return x.decode() if isinstance(x, bytes) else str(x)


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
