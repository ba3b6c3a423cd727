"""`python -m flexdraft_jax eval --config configs/eval_smollm2.py --workdir DIR`.

Runs benchmarks × batch sizes × modes × temperatures (+ the ablation cells)
and writes, in DIR:

  results.json   every finished cell, keyed by its parameters (the resume state),
                 and what they share (target, drafter, dtype, eval settings, prompts;
                 written before the first cell: a rerun with others is refused)
  results.csv    one row per cell: τ, tokens/s, speedup over AR, lossless, …
  results.md     speedup / τ tables and the ablation table
  *.png          speedup vs batch size, τ per dataset, accepted-length histograms

Prompts are the first `eval.limit` of each benchmark file (benchmarks.py), or
those of `eval.prompts_file`. A cell generates its prompts once untimed on a
warm-up batch of the same shapes, then timed (decode only, prefill excluded);
if anything but a prefill compiled during the timed run it is timed again. Speedup = AR time per output
token ÷ the cell's (SPEC §5), against the AR cell of the same dataset, batch
size and temperature. At T=0 each cell's tokens must equal the AR cell's; a
divergence is excused only where the target's top-2 logits are within
`eval.lossless_tol` at the divergence point.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from typing import Optional

import ml_collections

from flexdraft_jax import run_control
from flexdraft_jax.evaluation import benchmarks, cells as cells_lib
from flexdraft_jax.evaluation.cells import Context
from flexdraft_jax.evaluation.plan import (NO_PARALLEL, ablation_rows, check_settings,
                                           dataset_name, parse_list, plan_cells,
                                           resolve_path, runnable)
from flexdraft_jax.model.config import FlexDraftError

RESULTS_FILE = "results.json"
FORMAT_VERSION = 1
SHIPPED_DRAFTER = "flexdraft_jax/drafters/smollm2_135m_L8"

# Settings every cell of a workdir shares: each changes a cell's tokens, timings
# or lossless verdict and is not in its key (a change needs another workdir).
# results.json records them, with `dtype`, before its first cell.
SHARED_SETTINGS = ("max_new_tokens", "limit", "batches_per_cell", "seed", "strategy",
                   "flex_threshold", "attn_impl", "block_size", "max_len", "warmup",
                   "max_timing_runs", "lossless_tol")


def default_config() -> ml_collections.ConfigDict:
  """Every field the sweep reads, with defaults; configs/eval_*.py adjust it."""
  from flexdraft_jax.paths import data_root
  c = ml_collections.ConfigDict()
  c.name = "eval"
  c.target = "smollm2-135m"      # a load_target spec (random:NAME for tests)
  c.dtype = "float32"
  c.drafter = SHIPPED_DRAFTER     # a save_drafter directory (relative: cwd, then repo)
  # Used (with a loud note) when `drafter` does not exist and allow is True.
  c.random_drafter = ml_collections.ConfigDict(dict(
      allow=True, num_layers=4, block_size=16, calib_rank=256, seed=0))
  c.data_dir = data_root()        # $FLEXDRAFT_DATA, else <repo>/../shared/data
  c.eval = ml_collections.ConfigDict(dict(
      datasets="gsm8k,math500,humaneval,mbpp,mt_bench",
      limit=16,                   # prompts per dataset (the first ones of the file; -1: all)
      # At most this many batches per cell (0: all): a cell of batch size b
      # runs the first b·batches_per_cell prompts, so small batches do not
      # dominate a CPU sweep while batch 16 still gets 16 prompts.
      batches_per_cell=0,
      # JSON {dataset: [prompt, …]} replacing benchmark files; a prompt is a
      # string or a list of user turns. Names need not be benchmarks.
      prompts_file="",
      batch_sizes="1,4,16",
      modes="ar,parallel,parallel_sel,sequential,flex",
      temperatures="0",
      max_new_tokens=256,
      theta=0.01,                 # θ of parallel_sel (and of flex's parallel steps)
      strategy="cumulative_product",
      flex_threshold="auto",      # B*: "auto" or an integer
      seed=0,
      warmup=True,
      max_timing_runs=3,          # timed runs until one compiles nothing new
      max_len=0,                  # KV-cache length; 0: per dataset and turn
      block_size=0,               # 0: the drafter's
      attn_impl="xla",
      lossless_tol=1e-5))
  c.ablation = ml_collections.ConfigDict(dict(
      enabled=True, datasets="gsm8k,mt_bench", batch_sizes="1",
      # drafters with L draft layers; "" = the main drafter if it has L layers
      layer_drafters=ml_collections.ConfigDict(dict(L2="", L4="", L6="", L8=""))))
  return c


def load_main_drafter(config, target) -> tuple:
  """(Drafter, info) from `config.drafter`, or a random one when it is missing
  and `config.random_drafter.allow` (info["kind"] says which)."""
  from flexdraft_jax import api
  path = resolve_path(config.drafter)
  if path and os.path.isdir(path):
    drafter = api.load_drafter(path, target)
    return drafter, {"kind": "trained", "path": path, "id": trained_id(path),
                     "config": dataclasses.asdict(drafter.config), "note": ""}
  rd = config.random_drafter
  if not rd.allow:
    raise FlexDraftError(f"no drafter at {path}: train one (python -m flexdraft_jax "
                         "train) or pass --config.random_drafter.allow=True")
  import jax
  from flexdraft_jax.drafter.model import Drafter, DrafterConfig, init_draft_params
  dcfg = DrafterConfig(num_layers=min(rd.num_layers, target.config.num_layers),
                       block_size=rd.block_size, calib_rank=rd.calib_rank)
  params = init_draft_params(target.params, target.config, dcfg, jax.random.PRNGKey(rd.seed))
  where = f"at {path}" if path else "given (drafter path is empty)"
  note = (f"NO TRAINED DRAFTER {where}: using a RANDOMLY INITIALISED drafter "
          f"(L={dcfg.num_layers}, bs={dcfg.block_size}); its τ and speedups say "
          "nothing about FlexDraft")
  return Drafter(dcfg, params, target.fingerprint), {
      "kind": "random", "path": path, "config": dataclasses.asdict(dcfg), "note": note,
      "id": f"random:{dcfg.num_layers}:{dcfg.block_size}:{dcfg.calib_rank}:{rd.seed}"}


def trained_id(path: str) -> str:
  """A saved drafter's identity: the digest of its drafter.json."""
  with open(os.path.join(path, "drafter.json"), "rb") as f:
    return f"trained:{hashlib.sha256(f.read()).hexdigest()[:16]}"


# ------------------------------------------------------------- results ----

def _prompts_digest(rows: list) -> str:
  h = hashlib.sha256(json.dumps([[p.uid, list(p.turns)] for p in rows]).encode())
  return h.hexdigest()[:16]


def load_results(workdir: str) -> dict:
  path = os.path.join(workdir, RESULTS_FILE)
  if not os.path.exists(path):
    return {"version": FORMAT_VERSION, "meta": {}, "cells": {}, "ablation": []}
  try:
    with open(path) as f:
      results = json.load(f)
  except (OSError, ValueError) as e:
    raise FlexDraftError(f"cannot read {path}: {e}") from None
  if not (isinstance(results, dict) and isinstance(results.get("cells"), dict)
          and isinstance(results.get("meta"), dict)):
    what = (f"an object without {{'meta': {{…}}, 'cells': {{…}}}}" if isinstance(results, dict)
            else f"a JSON {type(results).__name__}")
    raise FlexDraftError(f"{path} is not the results of an eval sweep ({what}); it is left "
                         "as it is: use another --workdir")
  if results.get("version") != FORMAT_VERSION:
    raise FlexDraftError(f"{path} has format version {results.get('version')}, "
                         f"this code writes {FORMAT_VERSION}; use another --workdir")
  return results


def save_results(workdir: str, results: dict) -> str:
  path = os.path.join(workdir, RESULTS_FILE)
  with open(path + ".tmp", "w") as f:
    json.dump(results, f)
  os.replace(path + ".tmp", path)
  return path


def run_settings(config) -> dict:
  """The settings results.json records (meta["settings"]): `dtype` and the
  SHARED_SETTINGS of `config.eval`."""
  return {"dtype": config.dtype, **{k: config.eval[k] for k in SHARED_SETTINGS}}


def _check_settings(old: dict, new: dict, workdir: str) -> None:
  """Refuses (one line, naming the setting) cells of other settings or prompts:
  `new` holds "settings" and "prompts", what needs no model."""
  if not old:
    return
  recorded = old.get("settings", {})
  for key, value in new["settings"].items():
    name = key if key == "dtype" else f"eval.{key}"
    if key not in recorded:
      raise FlexDraftError(f"{workdir} holds results that do not record {name} (made "
                           f"before it was recorded), here {value!r}; use another --workdir")
    if recorded[key] != value:
      raise FlexDraftError(f"{workdir} holds results for {name}={recorded[key]!r}, not "
                           f"{value!r}; use another --workdir")
  for ds, digest in new["prompts"].items():
    if old["prompts"].get(ds, digest) != digest:
      raise FlexDraftError(f"{workdir} holds {ds} results for other prompts; "
                           "use another --workdir")


def _check_meta(old: dict, new: dict, workdir: str) -> dict:
  """Refuses to mix cells of different targets, drafters, settings or prompts;
  returns the meta to record."""
  if not old:
    return new
  _check_settings(old, new, workdir)
  for key in ("target_fingerprint", "drafter_id"):
    if old.get(key) != new[key]:
      raise FlexDraftError(f"{workdir} holds results for {key}={old.get(key)!r}, not "
                           f"{new[key]!r}; use another --workdir")
  layers = old.get("layer_drafters", {})
  for name, ident in new.get("layer_drafters", {}).items():
    if layers.get(name, ident) != ident:
      raise FlexDraftError(f"{workdir} holds results for ablation.layer_drafters.{name}="
                           f"{layers[name]!r}, not {ident!r} (another drafter); use "
                           "another --workdir")
  merged = dict(old)
  merged["prompts"] = {**old["prompts"], **new["prompts"]}
  merged["ablation_drafters"] = {**old.get("ablation_drafters", {}),
                                 **new["ablation_drafters"]}
  merged["layer_drafters"] = {**layers, **new.get("layer_drafters", {})}
  return merged


def read_prompts_file(path: str) -> dict:
  """{dataset: [str or [turn, …]]} from a JSON file."""
  try:
    with open(resolve_path(path)) as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise FlexDraftError(f"cannot read prompts file {path}: {e}") from None
  if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
    raise FlexDraftError(f"prompts file {path} must hold {{dataset: [prompt, ...]}}")
  return data


def _as_prompt(dataset: str, i: int, p) -> benchmarks.BenchmarkPrompt:
  if isinstance(p, benchmarks.BenchmarkPrompt):
    return p
  turns = (p,) if isinstance(p, str) else tuple(p)
  if not turns or not all(isinstance(t, str) for t in turns):
    raise FlexDraftError(f"{dataset} prompt {i} must be a string or a list of strings")
  return benchmarks.BenchmarkPrompt(f"{dataset}:{i}", dataset, turns)


def _load_prompts(config, datasets, explicit: Optional[dict]) -> dict:
  explicit = {**(read_prompts_file(config.eval.prompts_file)
                 if config.eval.prompts_file else {}), **(explicit or {})}
  limit = config.eval.limit
  out = {}
  for ds in datasets:
    if ds in explicit:
      rows = [_as_prompt(ds, i, p) for i, p in enumerate(explicit[ds])]
      out[ds] = rows[:limit] if limit > 0 else rows
    else:
      out[ds] = benchmarks.load_benchmark(ds, config.data_dir, limit)
    if not out[ds]:
      raise FlexDraftError(f"{ds}: no prompts")
  return out


def run_sweep(config, workdir: str, *, prompts: Optional[dict] = None, target=None,
              drafter=None, progress: bool = True) -> dict:
  """Runs every cell not yet in `workdir/results.json`, then writes the reports.

  `prompts` ({dataset: [str, [turns] or BenchmarkPrompt]}) replaces benchmark files;
  `target` / `drafter` replace loading `config.target` / `config.drafter`.
  Returns {"ran", "skipped", "results", "files", "skipped_cells", "only_baseline"}:
  `skipped_cells` {cell: why} were planned and not run (results.md lists them),
  `only_baseline` is true when speculative cells were asked and none ran.
  One sweep per workdir at a time (WORKDIR/flexdraft.lock names it); Ctrl-C or
  SIGTERM keeps every finished cell and raises `run_control.Stopped`.
  """
  from flexdraft_jax.cli_util import writable_dir
  # Settings, prompts and the workdir are checked before the (slow) model load.
  check_settings(config)
  datasets = {c.dataset for c in plan_cells(config, [])}
  if config.ablation.enabled:
    datasets |= set(parse_list(config.ablation.datasets, dataset_name))
  early_prompts = _load_prompts(config, sorted(datasets), prompts)
  workdir = writable_dir(workdir)
  with run_control.folder_lock(workdir, "eval"):
    # one it cannot resume, or cells of other settings: one line before the model loads
    _check_settings(load_results(workdir)["meta"], {
        "settings": run_settings(config),
        "prompts": {ds: _prompts_digest(r) for ds, r in early_prompts.items()}}, workdir)
    try:
      return _sweep(config, workdir, early_prompts, target, drafter, progress)
    except KeyboardInterrupt as e:
      path = os.path.join(workdir, RESULTS_FILE)
      done = len(load_results(workdir)["cells"])
      raise run_control.stopped(e, f"eval with {done} cells done, kept in {path} "
                                "(results.md is written when a sweep ends)") from None


def _sweep(config, workdir: str, early_prompts: dict, target, drafter,
           progress: bool) -> dict:
  import tqdm

  from flexdraft_jax import api
  from flexdraft_jax.evaluation import report
  if progress:
    print(f"eval: writing results to {workdir} (--workdir)", flush=True)
  if target is None:
    target = api.load_target(config.target, dtype=config.dtype, layout="layers")
  if drafter is None:
    drafter, info = load_main_drafter(config, target)
  else:
    info = {"kind": "given", "path": "", "note": "", "config": dataclasses.asdict(drafter.config),
            "id": f"given:{hashlib.sha256(repr(dataclasses.asdict(drafter.config)).encode()).hexdigest()[:8]}"}
  if info["note"]:
    print(f"\n{'!' * 78}\n!! {info['note']}\n{'!' * 78}\n", file=sys.stderr, flush=True)
  abl, extra, options = ablation_rows(config, target, drafter)
  drafters = {"main": drafter, **extra}
  abl = [dict(r, cells=[], note=NO_PARALLEL) if not all(
      runnable(c, drafters) for c in r["cells"]) else r for r in abl]
  cells = plan_cells(config, abl)
  skipped_cells = {c.key: NO_PARALLEL for c in cells if not runnable(c, drafters)}
  if skipped_cells:
    print(f"eval: {len(skipped_cells)} parallel cells skipped: {NO_PARALLEL}",
          file=sys.stderr, flush=True)
  planned_speculative = any(c.mode != "ar" for c in cells)
  cells = [c for c in cells if c.key not in skipped_cells]
  prompts_by_ds = {ds: early_prompts[ds] for ds in sorted({c.dataset for c in cells})}
  block = max(d.config.block_size for d in drafters.values())
  ctx = Context(config, target, drafters, prompts_by_ds,
                cells_lib.max_lens(target, prompts_by_ds, config, block), options)

  results = load_results(workdir)
  meta = {"target": target.name, "target_fingerprint": target.fingerprint,
          "drafter": info, "drafter_id": info["id"],
          "settings": run_settings(config),
          "prompts": {ds: _prompts_digest(r) for ds, r in prompts_by_ds.items()},
          "ablation_drafters": {k: d.config.num_layers for k, d in extra.items()},
          "layer_drafters": {name: trained_id(resolve_path(path)) for name, path in
                             dict(config.ablation.layer_drafters).items()
                             if name in extra and path},
          "data_dir": config.data_dir}
  results["meta"] = _check_meta(results["meta"], meta, workdir)
  results["ablation"] = [dict(r, cells=[c.key for c in r["cells"]]) for r in abl]
  results["ablation_settings"] = {"datasets": parse_list(config.ablation.datasets),
                                  "batch_sizes": parse_list(config.ablation.batch_sizes, int)}
  results["skipped_cells"] = skipped_cells  # this run's plan: what it left out and why
  # What the cells will be made with is on disk before the first of them: a sweep
  # stopped at any point is resumed with the same settings only.
  with run_control.critical():
    save_results(workdir, results)
  cells_lib.listen_for_compiles()

  ran = skipped = 0
  bar = tqdm.tqdm(cells, desc="eval", unit="cell", disable=not progress, dynamic_ncols=True)
  for cell in bar:
    bar.set_postfix_str(cell.key, refresh=False)
    if cell.key in results["cells"]:
      skipped += 1
      continue
    reference = results["cells"].get(cell.ar_key)
    results["cells"][cell.key] = cells_lib.run_cell(ctx, cell, reference)
    with run_control.critical():
      save_results(workdir, results)
    ran += 1
  bar.close()
  with run_control.critical():
    save_results(workdir, results)
  files = report.write_all(results, workdir)
  only_baseline = planned_speculative and not any(c.mode != "ar" for c in cells)
  return {"ran": ran, "skipped": skipped, "results": results, "files": files,
          "skipped_cells": skipped_cells, "only_baseline": only_baseline}


# ----------------------------------------------------------------- CLI ----

def run(argv):
  """Entry from `python -m flexdraft_jax eval --config … --workdir DIR`."""
  from flexdraft_jax import cli_util
  from flexdraft_jax.cli_util import define_flags
  define_flags(argv, workdir="where results.json/.csv/.md and the plots go (resumable)")

  def main(args):
    config, workdir = cli_util.config_and_workdir(args, "configs/eval_smollm2.py")
    out = run_sweep(config, workdir)
    print(f"eval: {out['ran']} cells run, {out['skipped']} already done; "
          f"{os.path.join(workdir, 'results.md')}", flush=True)
    if out["only_baseline"]:
      why = sorted({w.removeprefix("skipped: ") for w in out["skipped_cells"].values()})
      raise FlexDraftError(f"nothing but the AR baseline ran: {len(out['skipped_cells'])} "
                           f"cells skipped ({'; '.join(why)}); "
                           f"{os.path.join(workdir, 'results.md')} lists them")

  cli_util.run_main(main, argv, doc=__doc__)
