"""`python -m flexdraft_jax regenerate --config configs/X.py`: the target answers
training prompts (chat template, greedy) and its answers become a tfds dataset.

Resumable: each batch of answered prompts is written as a shard as soon as it
is done and prompts already in a shard are skipped; the tfds dataset
(array_record) is rebuilt from all shards at the end. REGEN_DIR gets:

  meta.json   target name + fingerprint, generation settings (written before the
              first answer: a rerun with other settings is refused), throughput
  shards/     shard-NNNNN.jsonl: {uid, source, prompt_ids, answer_ids}
  tfds/       flexdraft_regen/1.0.0/… (read with regen_store.load_records)
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time

import tqdm

from flexdraft_jax import run_control
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.decoding import timing
from flexdraft_jax.model import loading
from flexdraft_jax.training import prompt_mix, regen_store
from flexdraft_jax.training.config import check_data_config, parse_part
from flexdraft_jax.util import round_up


def prompt_ids(tokenizer, text: str, chat_kwargs: dict) -> list:
  """The chat-templated prompt as token ids (the exact ids the target sees)."""
  ids = tokenizer.apply_chat_template(text, add_generation_prompt=True, **chat_kwargs)
  if isinstance(ids, str):  # a tokenizer that renders text: encode it as is
    ids = tokenizer.encode(ids)
  return [int(t) for t in ids]


def _settings(config) -> dict:
  """What the answers depend on that the config says (checked before the model
  loads); the target's fingerprint joins them once it is loaded."""
  dc = config.data
  return {"max_new_tokens": dc.max_new_tokens, "chat_kwargs": dict(dc.chat_kwargs),
          "dtype": str(config.dtype)}


def _read_meta(regen_dir: str) -> dict:
  path = os.path.join(regen_dir, "meta.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _check_meta(regen_dir: str, settings: dict) -> dict:
  """Refuses to mix answers of different targets or settings in one dir (the
  settings recorded in its meta.json, which is written before the first
  answer); returns that meta ({} where there is none)."""
  old = _read_meta(regen_dir)
  if not old:
    shards = glob.glob(os.path.join(regen_store.shard_dir(regen_dir), "shard-*.jsonl"))
    if shards:  # an earlier version's run, stopped before it wrote meta.json
      raise FlexDraftError(
          f"{regen_dir} holds {len(shards)} shards of answers but no meta.json saying "
          "which target and settings made them; use another --config.data.regen_dir")
    return old
  differ = regen_store.settings_differ(old, settings)
  if differ:
    key, was, now = differ
    raise FlexDraftError(
        f"{regen_dir} holds answers with {key}={was!r}, not {now!r}; use another "
        "--config.data.regen_dir")
  return old


def _write_meta(regen_dir: str, meta: dict) -> None:
  path = os.path.join(regen_dir, "meta.json")
  with open(path + ".tmp", "w") as f:
    json.dump(meta, f, indent=1)
  os.replace(path + ".tmp", path)


def regenerate(config, *, limit: int = 0, max_minutes: float = 0.0) -> dict:
  """Answers every not-yet-answered prompt of the mix; returns meta (with
  throughput). `limit` > 0 stops after that many new prompts, `max_minutes`
  > 0 starts no new batch after that long; the dataset is built either way.
  One run per regen_dir at a time (REGEN_DIR/flexdraft.lock names it); Ctrl-C
  or SIGTERM keeps every finished shard and raises `run_control.Stopped`
  saying so (rerunning goes on from them)."""
  from flexdraft_jax.cli_util import writable_dir
  dc = config.data
  check_data_config(dc)
  regen_dir = writable_dir(dc.regen_dir, "--config.data.regen_dir")
  with run_control.folder_lock(regen_dir, "regenerate", "--config.data.regen_dir"):
    run = {"answers": 0, "building": False}
    try:
      return _regenerate(config, regen_dir, limit, max_minutes, run)
    except KeyboardInterrupt as e:
      if run.get("bar") is not None:
        run["bar"].close()
      for tmp in glob.glob(os.path.join(regen_store.shard_dir(regen_dir), "*.tmp")):
        os.remove(tmp)
      if run["building"]:  # a half-built dataset: the rerun builds it
        shutil.rmtree(regen_store.tfds_dir(regen_dir), ignore_errors=True)
      kept = len(glob.glob(os.path.join(regen_store.shard_dir(regen_dir), "shard-*.jsonl")))
      raise run_control.stopped(e, f"regenerate after {run['answers']} new answers; "
                                f"{kept} shards kept in {regen_store.shard_dir(regen_dir)} "
                                "(the dataset is built when a run ends)") from None


def _regenerate(config, regen_dir: str, limit: int, max_minutes: float, run: dict) -> dict:
  dc = config.data
  print(f"regenerate: writing to {regen_dir} (--config.data.regen_dir, default "
        "$FLEXDRAFT_RUNS/regen/NAME, else <repo>/../runs/regen/NAME)", flush=True)
  settings = _settings(config)
  _check_meta(regen_dir, settings)  # other settings: one line before the model load
  prompts = prompt_mix.load_prompts(dc)  # missing prompt files: one line before the model load
  target = loading.load_target(config.target, config.dtype)
  chat_kwargs = settings["chat_kwargs"]
  meta = {"target": target.name, "target_fingerprint": target.fingerprint, **settings,
          "max_prompt_tokens": dc.max_prompt_tokens, "greedy": True}
  old = _check_meta(regen_dir, meta)
  # The settings are on disk before the first answer: a run stopped at any point
  # leaves them beside its shards, and a rerun with others is refused.
  meta = {**old, **meta}
  with run_control.critical():
    _write_meta(regen_dir, meta)
  regen_store.use_packed(dc)

  done = {r["uid"] for r in regen_store.read_shards(regen_dir)}
  part = parse_part(dc.part) if dc.part else None
  todo, skipped = [], 0
  for p in prompts:
    if p.uid in done or (part and prompt_mix.stable_int(p.uid) % part[1] != part[0]):
      continue
    ids = prompt_ids(target.tokenizer, p.text, chat_kwargs)
    if len(ids) > dc.max_prompt_tokens:
      skipped += 1
      continue
    todo.append((p, ids))
  if limit:
    todo = todo[:limit]
  # Similar lengths together (less padding) within windows of 8 batches, so a
  # run stopped early still holds a sample of the whole mix.
  window = 8 * dc.batch_size
  todo = [x for w in range(0, len(todo), window)
          for x in sorted(todo[w:w + window], key=lambda x: (len(x[1]), x[0].uid))]
  print(f"regenerate: {len(done)} answered, {len(todo)} to answer, {skipped} "
        f"prompts over {dc.max_prompt_tokens} tokens skipped; target {target.name}",
        flush=True)

  from flexdraft_jax.decoding.engine import generate
  from flexdraft_jax.decoding.options import RuntimeOptions
  shard = regen_store.next_shard_index(regen_dir)
  # Regeneration's rate: every answer token per second of `generate` calls
  # (prefill included: it is part of answering a prompt).
  new_tokens, gen_seconds = 0, 0.0
  eos = set(int(t) for t in target.config.eos_token_ids)
  # One cache size for every batch: the decode loop compiles once per batch size.
  max_len = round_up(dc.max_prompt_tokens + dc.max_new_tokens + 64, 64)
  bar = run["bar"] = tqdm.tqdm(total=len(todo), unit="prompt", dynamic_ncols=True)
  t_start = time.perf_counter()
  for start in range(0, len(todo), dc.batch_size):
    if max_minutes and time.perf_counter() - t_start > 60 * max_minutes:
      bar.write(f"regenerate: stopping after {max_minutes} minutes (resumable)")
      break
    chunk = todo[start:start + dc.batch_size]
    t0 = time.perf_counter()
    res = generate(target, [ids for _, ids in chunk], max_new_tokens=dc.max_new_tokens,
                   runtime=RuntimeOptions(batch_size=len(chunk), max_len=max_len))
    dt = time.perf_counter() - t0
    records = []
    for (p, ids), ans in zip(chunk, res.token_ids):
      ans = [int(t) for t in ans]
      new_tokens += len(ans)
      records.append({"uid": p.uid, "source": p.source, "prompt_ids": ids,
                      "answer_ids": ans, "stopped": bool(ans and ans[-1] in eos)})
    with run_control.critical():  # a shard is written whole or not at all
      regen_store.write_shard(regen_dir, shard, records)
      run["answers"] += len(records)
    shard += 1
    gen_seconds += dt
    bar.update(len(chunk))
    bar.set_postfix(tok_s=f"{timing.tokens_per_second(new_tokens, gen_seconds):.1f}")
  bar.close()
  meta.update(last_run_new_tokens=new_tokens, last_run_seconds=round(gen_seconds, 2),
              last_run_tokens_per_s=round(timing.tokens_per_second(new_tokens, gen_seconds), 2),
              records=len(regen_store.read_shards(regen_dir)))
  with run_control.critical():
    _write_meta(regen_dir, meta)
  run["building"] = True
  meta["tfds_dir"] = regen_store.build_dataset(regen_dir)
  print(json.dumps(meta), flush=True)
  return meta


def run(argv):
  from absl import flags

  from flexdraft_jax import cli_util
  from flexdraft_jax.cli_util import define_flags
  define_flags(argv, workdir=False)
  if "limit" not in flags.FLAGS:
    flags.DEFINE_integer("limit", 0, "answer at most this many new prompts (0: all)")
    flags.DEFINE_float("max_minutes", 0.0, "start no new batch after this many "
                       "minutes (0: no limit); rerun to continue")

  def main(args):
    if len(args) > 1:
      raise FlexDraftError(f"unexpected arguments: {' '.join(args[1:])}")
    config = cli_util.load_config("configs/smollm2_135m.py")
    if flags.FLAGS.limit < 0 or flags.FLAGS.max_minutes < 0:
      raise FlexDraftError("--limit and --max_minutes must be >= 0 (0: no limit)")
    regenerate(config, limit=flags.FLAGS.limit, max_minutes=flags.FLAGS.max_minutes)

  cli_util.run_main(main, argv, doc=__doc__, key_flags=("config", "limit", "max_minutes"))
