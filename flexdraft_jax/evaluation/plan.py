"""What an eval sweep runs: its cells (benchmarks × batch sizes × modes ×
temperatures, AR first), the settings checked before a model loads, and the
ablation rows with the drafter variants they compare (sweep.py runs them)."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from flexdraft_jax.decoding.options import Mode, parse_flex_threshold
from flexdraft_jax.decoding.sampling import MIN_TEMPERATURE
from flexdraft_jax.evaluation import benchmarks
from flexdraft_jax.evaluation.cells import MODES, Cell
from flexdraft_jax.model.config import FlexDraftError

PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_list(value, cast=str) -> list:
  """"1,4,16" / 4 / (1, 4) -> [cast(x), …]."""
  if isinstance(value, str):
    items = [x.strip() for x in value.split(",") if x.strip()]
  elif isinstance(value, (list, tuple)):
    items = list(value)
  else:
    items = [value]
  try:
    return [cast(x) for x in items]
  except ValueError:
    raise FlexDraftError(f"cannot read {value!r} as a list of {cast.__name__}") from None


def dataset_name(name: str) -> str:
  """A benchmark's canonical name; other names are kept (prompts_file data sets)."""
  name = name.strip()
  try:
    return benchmarks.canonical_name(name)
  except FlexDraftError:
    return name


def resolve_path(path: str) -> str:
  """An absolute path; a relative one is tried from the cwd, then the repo root."""
  if not path or os.path.isabs(path):
    return path
  if os.path.exists(path):
    return os.path.abspath(path)
  return os.path.join(PACKAGE_PARENT, path)


def without_calibration(drafter):
  """The same drafter decoding without its calibration MLP (not even computed)."""
  return drafter._replace(config=dataclasses.replace(drafter.config, calibrate=False))


def without_ngram(drafter):
  """The same drafter drafting without its n-gram prior (the tables unread)."""
  return drafter._replace(config=dataclasses.replace(
      drafter.config, ngram_weight=0.0, context_trigram=0.0, context_bigram=0.0))


def without_bonus_input(drafter):
  """The same drafter with slot 0 always blind (the mask alone), in every mode."""
  params = {k: v for k, v in drafter.params.items() if k != "bonus_in"}
  return drafter._replace(config=dataclasses.replace(
      drafter.config, bonus_input=False, bonus_dropout=0.0), params=params)


def _calibration_is_identity(drafter) -> bool:
  c = drafter.params["calib"]
  return not (np.any(np.asarray(c["w2"])) or np.any(np.asarray(c["b2"])))


NO_PARALLEL = ("skipped: parallel mode drafts before the bonus is known and this "
               "drafter was trained to read it (bonus_input without bonus_dropout)")


def runnable(cell: Cell, drafters: dict) -> bool:
  """False for a parallel cell of a drafter that was not trained to draft
  before the bonus is known (DrafterConfig.drafts_blind)."""
  if MODES[cell.mode][0] != Mode.PARALLEL:
    return True
  return drafters[cell.drafter].config.drafts_blind


def make_cell(dataset, batch_size, mode, temperature, theta, drafter="main") -> Cell:
  if mode == "ar":
    return Cell(dataset, batch_size, "ar", temperature)
  return Cell(dataset, batch_size, mode, temperature,
              theta if MODES[mode][1] else 0.0, drafter)


def check_settings(config) -> None:
  """Range checks of `config.eval` that need no model (run before loading one)."""
  from flexdraft_jax.decoding import options
  ec = config.eval
  for t in parse_list(ec.temperatures, float):
    if not math.isfinite(t) or t < 0:
      raise FlexDraftError(f"--config.eval.temperatures: each must be a finite number "
                           f">= 0, got {t}")
    if 0 < t < MIN_TEMPERATURE:  # logits / T overflows float32 (sampling.py)
      raise FlexDraftError(f"--config.eval.temperatures: each must be 0 (greedy) or >= "
                           f"{MIN_TEMPERATURE:g}, got {t:g}")
  for b in parse_list(ec.batch_sizes, int) + parse_list(config.ablation.batch_sizes, int):
    if b < 1:
      raise FlexDraftError(f"--config.eval.batch_sizes and --config.ablation.batch_sizes "
                           f"must be >= 1, got {b}")
  for name, low in (("max_new_tokens", 1), ("batches_per_cell", 0),
                    ("max_timing_runs", 1), ("max_len", 0), ("block_size", 0)):
    v = ec[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
      raise FlexDraftError(f"--config.eval.{name} must be an integer >= {low}, got {v!r}")
  check_limit(ec.limit, "--config.eval.limit")
  # An empty list ran the AR baseline alone (modes) or nothing, and reported success.
  for name in ("datasets", "modes", "batch_sizes", "temperatures"):
    if not parse_list(ec[name]):
      raise FlexDraftError(f"--config.eval.{name} is empty: name at least one (e.g. "
                           f"--config.eval.{name}={default_config_value(name)})")
  try:
    options.SpecOptions(threshold=ec.theta, strategy=ec.strategy,
                        flex_threshold=parse_flex_threshold(ec.flex_threshold,
                                                            "eval.flex_threshold"))
    options.RuntimeOptions(attn_impl=ec.attn_impl)
  except FlexDraftError as e:
    raise FlexDraftError(f"--config.eval: {e}") from None


def check_limit(limit, flag: str) -> None:
  """Prompts per benchmark: >= 1, or -1 for all of them. 0 is refused: it read
  as "none" and ran every prompt."""
  if not isinstance(limit, int) or isinstance(limit, bool) or not (limit >= 1 or
                                                                   limit == -1):
    raise FlexDraftError(f"{flag} must be an integer >= 1 (prompts per benchmark), or -1 "
                         f"for every prompt, got {limit!r}")


def default_config_value(name: str) -> str:
  """An example value of an eval list setting, for error messages."""
  return {"datasets": "gsm8k,mt_bench", "modes": "ar,flex", "batch_sizes": "1,4",
          "temperatures": "0"}[name]


def plan_cells(config, ablation: list) -> list:
  """Every cell to run, AR first within each (dataset, batch, temperature)."""
  ec = config.eval
  modes = parse_list(ec.modes)
  for m in modes:
    if m not in MODES:
      raise FlexDraftError(f"unknown mode {m!r} in eval.modes (known: {', '.join(MODES)})")
  cells = []
  for ds in parse_list(ec.datasets, dataset_name):
    for temp in parse_list(ec.temperatures, float):
      for bs in parse_list(ec.batch_sizes, int):
        cells.append(make_cell(ds, bs, "ar", temp, 0.0))
        cells += [make_cell(ds, bs, m, temp, ec.theta) for m in modes if m != "ar"]
  for row in ablation:
    for cell in row["cells"]:
      cells += [Cell(cell.dataset, cell.batch_size, "ar", cell.temperature), cell]
  seen, out = set(), []
  for c in cells:
    if c.batch_size < 1:
      raise FlexDraftError(f"batch size must be >= 1, got {c.batch_size}")
    if c.key not in seen:
      seen.add(c.key)
      out.append(c)
  return out


def ablation_rows(config, target, main) -> tuple:
  """(rows, extra drafters, their generate options): each row names its cells
  or says why it is skipped. The paper's path first (its drafter: the main
  one without this project's additions), then each addition on top of flex."""
  from flexdraft_jax import api
  ab, ec = config.ablation, config.eval
  if not ab.enabled:
    return [], {}, {}
  datasets = parse_list(ab.datasets, dataset_name)
  batch_sizes = parse_list(ab.batch_sizes, int)

  def cells(mode, variant):
    return [make_cell(d, bs, mode, 0.0, ec.theta, variant)
            for bs in batch_sizes for d in datasets]

  same = ("calibration is the identity in this drafter (w2 = b2 = 0), so the two "
          "rows measure the same drafter" if _calibration_is_identity(main) else "")
  paper = without_bonus_input(without_ngram(main))
  reads = main.config.bonus_input
  # A variant that changes nothing in this drafter is the main one (no second cell).
  same_as_main = lambda d: d.config == main.config and d.params.keys() == main.params.keys()
  pv = "main" if same_as_main(paper) else "paper"
  nv = "main" if same_as_main(without_ngram(main)) else "nongram"
  rows = [
      dict(name="attention tuning only (no calibration)",
           cells=cells("parallel", "paper_nocalib"), note=same),
      dict(name="+ bonus calibration", cells=cells("parallel", pv), note=""),
      dict(name=f"+ selective verification (θ={ec.theta:g})",
           cells=cells("parallel_sel", pv), note=""),
      dict(name="flex (parallel and sequential)", cells=cells("flex", pv), note=""),
      dict(name="sequential", cells=cells("sequential", pv), note=""),
      dict(name="sequential + bonus input", cells=cells("sequential", nv),
           note="" if reads else "skipped: the drafter reads no bonus input"),
      dict(name="flex + bonus input", cells=cells("flex", nv),
           note="" if reads else "skipped: the drafter reads no bonus input"),
      dict(name="flex + bonus input + n-gram prior (the main drafter)",
           cells=cells("flex", "main"),
           note="" if main.config.rescores else "the drafter has no n-gram prior"),
      dict(name="the same with an fp32 draft pass (instead of auto: bf16 on a CPU)",
           cells=cells("flex", "fp32draft"), note=""),
  ]
  rows = [dict(r, cells=[]) if r["note"].startswith("skipped") else r for r in rows]
  drafters = {"paper_nocalib": without_calibration(paper), "fp32draft": main}
  if pv != "main":
    drafters["paper"] = paper
  if nv != "main":
    drafters["nongram"] = without_ngram(main)
  options = {"fp32draft": {"draft_dtype": "target"}}
  for name, path in sorted(dict(ab.layer_drafters).items(), key=lambda kv: int(kv[0][1:])):
    n = int(name[1:])
    row = dict(name=f"L = {n} draft layers (θ={ec.theta:g})", cells=[], note="")
    if not path:
      if main.config.num_layers == n:
        row.update(cells=cells("parallel_sel", "main"), note="the main drafter")
      else:
        row["note"] = f"skipped: no drafter path set (ablation.layer_drafters.{name})"
    else:
      full = resolve_path(path)
      if not os.path.isdir(full):
        row["note"] = f"skipped: no drafter at {full}"
      else:
        try:
          d = api.load_drafter(full, target)
        except FlexDraftError as e:
          row["note"] = f"skipped: {e}"
        else:
          if d.config.num_layers != n:
            row["note"] = f"skipped: {full} has L={d.config.num_layers}, not {n}"
          else:
            drafters[name] = d
            row.update(cells=cells("parallel_sel", name), note=full)
    rows.append(row)
  return rows, drafters, options
