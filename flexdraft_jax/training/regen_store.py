"""Regenerated data on disk: regenerate.py's JSONL shards, the tfds dataset
(array_record) built from them, `load_records` reading it back, and packing
it into one file (or merging another run's) to ship or resume."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil

import numpy as np
import tensorflow_datasets as tfds

from flexdraft_jax.model.config import FlexDraftError

DATASET_NAME = "flexdraft_regen"

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
    differ = settings_differ(old, meta)
    if differ:
      key, here, there = differ
      raise FlexDraftError(f"{regen_dir} holds answers with {key}={here!r}, {path} "
                           f"with {key}={there!r}: they do not mix in one folder")
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


# What answers in one regen dir must share: the target and how it answered
# (its compute dtype too: bfloat16 and float32 greedy answers part at near ties).
REGEN_SETTINGS = ("target_fingerprint", "max_new_tokens", "chat_kwargs", "dtype")


def settings_differ(old: dict, new: dict):
  """(setting, old value, new value) for the first of REGEN_SETTINGS that the
  metas `old` and `new` both record with different values; None when they
  agree. A setting one of them does not record (data regenerated before it
  was) is not compared."""
  for key in REGEN_SETTINGS:
    if key in old and key in new and old[key] != new[key]:
      return key, old[key], new[key]
  return None


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
  differ = settings_differ(metas[0], metas[1])
  if differ:
    key, dst, src = differ
    raise FlexDraftError(f"cannot merge {src_dir} into {dst_dir}: {key} {src!r} vs {dst!r}")
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
