"""AR, flex and fixed (mode, k) decoding, timed in alternation on the same prompts.

For each batch size B the prompts are the first N·B GSM8K test questions under
the chat template, decoded B rows at a time, greedy, stops off (every row decodes
`max_new_tokens`). Each round calls every setting once, in order — AR, flex, then
each fixed (mode, verify length k) — so a slow spell of a shared machine slows
one round of every setting instead of all rounds of one; the first round
compiles (and lets flex time its step costs) and is not timed. A setting's
decode tokens/s (SPEC §5: prefill, compiling and flex's cost timing left out) is
the median and the best of the timed rounds; end-to-end tokens/s counts prefill
too. Every output is checked against AR's: identical, or a tie of the target's
top-2 logits within `lossless_tol` at the first differing token
(`cells.check_lossless`, the eval sweep's rule).

Flex's own view sits next to what the fixed settings measured: the steps it ran
per (mode, k), τ per mode, its timed step costs, and the tokens/s its cost model
predicted for each (mode, k) over its run, as a ratio to its AR prediction, each
prediction weighed by the steps decoded on it (`stats["flex_choices"]`) —
comparable with each fixed setting's measured × AR, so a reader sees whether the
model agrees with measurement.

  settings = default_settings(parse_fixed(["sequential:4", "parallel:4"]))
  result = run(target, drafter, gsm8k_prompts(target, data_dir, 16),
               batch_sizes=[1, 2, 4, 8, 16], settings=settings)
  open("modes.md", "w").write(markdown(result))
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Optional, Sequence

from flexdraft_jax.decoding.capacity import spare_positions
from flexdraft_jax.decoding.options import TREE, Mode, RuntimeOptions, SpecOptions
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.evaluation import benchmarks
from flexdraft_jax.evaluation.cells import check_lossless
from flexdraft_jax.model.config import FlexDraftError

FIXED_MODES = (Mode.PARALLEL.value, Mode.SEQUENTIAL.value)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One timed decoding setting; `name` labels its column."""
  name: str
  mode: str                          # "ar" | "flex" | "parallel" | "sequential"
  verify_len: Optional[int] = None   # k; None: the drafter's block (flex: up to it)
  draft_dtype: str = "auto"
  threshold: float = 0.0             # selective verification θ (flex, parallel)
  tree_budget: Optional[int] = None  # draft trees of this many nodes (sequential, flex)

  @property
  def fixed(self) -> bool:
    return self.mode in FIXED_MODES

  def options(self, drafter, cost_cache=None) -> dict:
    """generate() keyword arguments of this setting."""
    if self.mode == Mode.AR:
      return dict(mode=Mode.AR, speculation=SpecOptions(cost_cache=cost_cache))
    return dict(mode=self.mode, drafter=drafter, speculation=SpecOptions(
        verify_len=self.verify_len, threshold=self.threshold,
        draft_dtype=self.draft_dtype, cost_cache=cost_cache, tree_budget=self.tree_budget))

  @property
  def key(self) -> Optional[str]:
    """The name flex gives this fixed setting's steps ("sequential:8", "tree:32")."""
    if self.tree_budget and self.mode == Mode.SEQUENTIAL:
      return f"{TREE}:{self.tree_budget}"
    return f"{self.mode}:{self.verify_len}" if self.fixed else None


def parse_fixed(specs: Sequence[str], draft_dtype: str = "auto") -> list:
  """Settings from "MODE:K[:DRAFT_DTYPE]" strings (MODE parallel or sequential),
  and "tree:N[:DRAFT_DTYPE]": sequential steps verifying draft trees of N nodes."""
  out = []
  for spec in specs:
    parts = spec.strip().split(":")
    if parts[0] == TREE and len(parts) in (2, 3) and parts[1].isdigit() and int(parts[1]) >= 2:
      out.append(Setting(spec.strip(), Mode.SEQUENTIAL.value, None,
                         parts[2] if len(parts) == 3 else draft_dtype,
                         tree_budget=int(parts[1])))
      continue
    if len(parts) not in (2, 3) or parts[0] not in FIXED_MODES or not parts[1].isdigit():
      raise FlexDraftError(f"fixed setting {spec!r}: expected MODE:K[:DRAFT_DTYPE] with "
                           f"MODE one of {FIXED_MODES} and K an integer ≥ 2, or "
                           f"tree:N with N an integer ≥ 2")
    if int(parts[1]) < 2:
      raise FlexDraftError(f"fixed setting {spec!r}: k must be at least 2 (one draft)")
    out.append(Setting(spec.strip(), parts[0], int(parts[1]),
                       parts[2] if len(parts) == 3 else draft_dtype))
  return out


def default_settings(fixed: Sequence[Setting], flex_dtypes: Sequence[str] = ("auto",),
                     threshold: float = 0.0, flex_trees: Sequence[int] = ()) -> list:
  """AR, flex (one per draft dtype: "flex", then "flex:DTYPE"; then one with
  draft trees per budget in `flex_trees`: "flex+tree:N"), then `fixed`."""
  flexes = [Setting("flex" if i == 0 else f"flex:{d}", Mode.FLEX, None, d, threshold)
            for i, d in enumerate(flex_dtypes)]
  flexes += [Setting(f"flex+{TREE}:{n}", Mode.FLEX, None, flex_dtypes[0], threshold,
                     tree_budget=n) for n in flex_trees]
  return [Setting("ar", Mode.AR)] + flexes + list(fixed)


def fit_settings(settings: Sequence[Setting], block_size: int) -> tuple:
  """(settings whose k fits the drafter's block, names of those that do not)."""
  keep = [s for s in settings if s.verify_len is None or s.verify_len <= block_size]
  return keep, [s.name for s in settings if s not in keep]


def gsm8k_prompts(target, data_dir: str, n: int, dataset: str = "gsm8k") -> list:
  """Token ids of the first `n` prompts of `dataset` (GSM8K test questions by
  default; multi-turn sets: their first turns) under the chat template."""
  rows = benchmarks.load_benchmark(dataset, data_dir, n)
  if len(rows) < n:
    raise FlexDraftError(f"{dataset}: {n} prompts needed, {data_dir} has {len(rows)}")
  kw = benchmarks.chat_kwargs(target)
  return [benchmarks.render(target.tokenizer, benchmarks.messages_for_turn(p, []), kw)
          for p in rows]


def run(target, drafter, prompts: Sequence, *, batch_sizes: Sequence[int],
        settings: Sequence[Setting], max_new_tokens: int = 64, repeats: int = 3,
        batches: int = 1, attn_impl: str = "xla", lossless_tol: float = 1e-5,
        temperature: float = 0.0, draft_sampling: Optional[bool] = None, cost_cache=None,
        deadline: Optional[float] = None, on_batch: Optional[Callable] = None,
        log: Callable = print) -> dict:
  """Times `settings` at each batch size (see the module doc); returns a dict for
  JSON (`markdown` renders it). `prompts` (id lists) holds at least
  max(batch_sizes)·batches rows. `deadline` (time.monotonic()) shares the time
  left evenly among the batch sizes still to run: a batch size stops its rounds
  when the next would end past its share (after one timed round), and is
  skipped when too little is left for it. `on_batch(result)` is called after
  each batch size (to write partial results). `draft_sampling`: SamplingParams'
  (None: auto, sampled drafts at T > 0 but with draft trees)."""
  names = [s.name for s in settings]
  if not names or names[0] != "ar" or len(set(names)) != len(names):
    raise FlexDraftError(f"settings must start with 'ar' and have distinct names: {names}")
  need = max(batch_sizes) * batches
  if len(prompts) < need:
    raise FlexDraftError(f"{need} prompts needed (batch {max(batch_sizes)} × {batches} "
                         f"batches), got {len(prompts)}")
  block = drafter.config.block_size if drafter is not None else 16
  result = {"max_new_tokens": max_new_tokens, "repeats": repeats, "batches": batches,
            "attn_impl": attn_impl, "lossless_tol": lossless_tol, "temperature": temperature,
            "draft_sampling": draft_sampling, "settings": [dataclasses.asdict(s) for s in settings], "results": []}
  last_wall = 0.0
  for i, b in enumerate(batch_sizes):
    share = None
    if deadline is not None:
      left = deadline - time.monotonic()
      share = left / (len(batch_sizes) - i)
      if left < last_wall:  # the previous batch size took longer than what is left
        log(f"modes_bench: batch {b} skipped ({left:.0f} s left of the time budget)")
        result["results"].append({"batch_size": b, "skipped": "time budget"})
        continue
    ids = [list(p) for p in prompts[:b * batches]]
    # one cache length for every batch of this size: one compiled shape per setting
    max_len = max(len(p) for p in ids) + max_new_tokens + spare_positions(
        block, max((s.tree_budget or 0) for s in settings))
    start = time.monotonic()
    row = bench_batch(target, drafter, ids, b, settings, max_new_tokens=max_new_tokens,
                      repeats=repeats, max_len=max_len, attn_impl=attn_impl,
                      lossless_tol=lossless_tol, temperature=temperature,
                      draft_sampling=draft_sampling, cost_cache=cost_cache,
                      deadline=None if share is None else start + share, log=log)
    last_wall = row["wall_seconds"] = time.monotonic() - start
    result["results"].append(row)
    if on_batch is not None:
      on_batch(result)
  return result


def bench_batch(target, drafter, ids: list, batch_size: int, settings: Sequence[Setting],
                *, max_new_tokens: int, repeats: int, max_len: int, attn_impl: str,
                lossless_tol: float, temperature: float = 0.0,
                draft_sampling: Optional[bool] = None, cost_cache=None,
                deadline: Optional[float] = None, log: Callable = print) -> dict:
  """One batch size: the rotation, the lossless checks, flex's view (module doc).
  At `temperature` > 0 every call samples with its own seed (the round), and
  outputs are not compared: sampling is lossless in distribution, which the χ²
  tests check, not token for token."""
  from flexdraft_jax import api
  timed = {s.name: {"decode": [], "e2e": []} for s in settings}
  outputs = {s.name: [] for s in settings}  # every call's token ids
  last = {}
  round_seconds = 0.0
  for r in range(repeats + 1):
    if r > 1 and deadline is not None and time.monotonic() + round_seconds > deadline:
      log(f"modes_bench: batch {batch_size}: {r - 1} of {repeats} timed rounds "
          "(time budget)")
      break
    t0 = time.monotonic()
    for s in settings:
      res = api.generate(target, ids, max_new_tokens=max_new_tokens, stop=[],
                         sampling=SamplingParams(temperature=temperature,
                                                 draft_sampling=draft_sampling), seed=r,
                         runtime=RuntimeOptions(batch_size=batch_size, max_len=max_len,
                                                attn_impl=attn_impl),
                         **s.options(drafter, cost_cache))
      st = res.stats
      if r:  # the first round compiles
        timed[s.name]["decode"].append(st["tokens_per_second"])
        timed[s.name]["e2e"].append(
            st["new_tokens"] / max(st["prefill_seconds"] + st["decode_seconds"], 1e-9))
      outputs[s.name].append(res.token_ids)
      last[s.name] = res
    if r:
      round_seconds = time.monotonic() - t0
  row = {"batch_size": batch_size, "rows": len(ids), "max_len": max_len,
         "attn_impl": attn_impl, "timed_rounds": len(timed["ar"]["decode"]), "settings": {}}
  reference = outputs["ar"][-1]
  for s in settings:
    row["settings"][s.name] = _setting_row(
        target, s, timed[s.name], last[s.name].stats, outputs[s.name],
        reference if temperature == 0 else None, ids, lossless_tol)
  ar = row["settings"]["ar"]
  for name, x in row["settings"].items():
    x["over_ar"] = x["median"] / ar["median"]
    x["e2e_over_ar"] = x["e2e_median"] / ar["e2e_median"]
  fixed = [s.name for s in settings if s.fixed]
  best = max(fixed, key=lambda n: row["settings"][n]["median"]) if fixed else None
  row["best_fixed"] = best
  flex = next((s.name for s in settings if s.mode == Mode.FLEX), None)
  # every flex setting's view (flex with draft trees too), the first's as "flex"
  row["flex_views"] = {s.name: flex_view(last[s.name].stats, batch_size, row["settings"])
                       for s in settings if s.mode == Mode.FLEX}
  if flex is not None:
    row["flex"] = row["flex_views"][flex]
    if best is not None:
      row["flex_over_best_fixed"] = (row["settings"][flex]["median"]
                                     / row["settings"][best]["median"])
  row["lossless"] = (all(x["lossless"] for x in row["settings"].values())
                    if temperature == 0 else None)  # None: not compared (T > 0)
  log(f"modes_bench: batch {batch_size}: " + ", ".join(
      f"{n} {x['median']:.1f} tok/s (τ {x['tau']:.2f})" for n, x in row["settings"].items())
      + f"; lossless: {_lossless_cell(row['lossless'])}")
  return row


def _setting_row(target, s: Setting, timed: dict, stats: dict, outputs: list,
                 reference: list, ids: list, tol: float) -> dict:
  """A setting's timings, τ and lossless check (every call's output against AR's)."""
  decode, e2e = timed["decode"], timed["e2e"]
  out = {"mode": s.mode, "verify_len": s.verify_len, "tree_budget": s.tree_budget,
         "key": s.key, "draft_dtype": stats.get("draft_dtype"),
         "tokens_per_second": decode, "median": statistics.median(decode),
         "best": max(decode), "e2e_tokens_per_second": e2e,
         "e2e_median": statistics.median(e2e), "e2e_best": max(e2e),
         "tau": stats["tau"], "mode_tau": stats.get("mode_tau", {}), "steps": stats["steps"],
         "new_tokens": stats["new_tokens"]}
  if s.mode == Mode.AR:
    out["lossless"], out["lossless_detail"] = True, {"reference": True}
  elif reference is None:  # sampled: not compared token for token
    out["lossless"], out["lossless_detail"] = None, {"sampled": True}
  else:
    out["lossless"], out["lossless_detail"] = check_outputs(target, reference, outputs, ids,
                                                            tol)
  return out


def check_outputs(target, reference: list, outputs: list, ids: list, tol: float) -> tuple:
  """(lossless, detail): each of `outputs` (several calls' token ids, rows
  of prompts `ids`) against AR's `reference` by `cells.check_lossless`."""
  details = []
  for got in {tuple(map(tuple, o)): o for o in outputs}.values():  # distinct outputs
    if got == reference:
      details.append({"identical": len(got), "ties": 0, "mismatched": 0})
      continue
    details.append(check_lossless(target, [[a] for a in reference], [[g] for g in got],
                                  [[p] for p in ids], tol))
  return (all(d["mismatched"] == 0 for d in details),
          details[0] if len(details) == 1 else details)


def flex_view(stats: dict, batch_size: int, measured: dict) -> dict:
  """Flex's steps per (mode, k), τ per mode, step costs, and the × AR its cost
  model predicted for each (mode, k) over its run (each prediction weighed by
  the steps decoded on it: a run's predictions refer to the rows then live, as
  the fixed settings' measurement covers all of them), next to the measured × AR."""
  choice = stats.get("flex_choices", {}).get(str(batch_size), {})
  pred, run = choice.get("tokens_per_s", {}), choice.get("run_predicted_over_ar", {})
  compare = {}
  for name, x in measured.items():
    key = "ar" if x["mode"] == Mode.AR else x.get("key")
    if key is None:
      continue
    p = pred.get(key)
    last = p / pred["ar"] if p and pred.get("ar") else None
    compare[name] = {"predicted_tokens_per_s": p, "last_predicted_over_ar": last,
                     "predicted_over_ar": run.get(key, last),
                     "measured_tokens_per_s": x["median"], "measured_over_ar": x["over_ar"]}
  return {"mode_k_steps": mode_k_steps(stats.get("mode_steps", []),
                                       stats.get("group_counts", [])),
          "mode_tau": stats.get("mode_tau", {}), "tau": stats["tau"],
          "step_costs": stats.get("step_costs", {}).get(str(batch_size)),
          "last_choice": choice, "cost_model_vs_measured": compare,
          "chunks": choice.get("chunks", {})}


def mode_k_steps(mode_log: list, k_log: list) -> list:
  """[[mode, k, steps], …] totals in first-seen order, from the engine's two
  run-length logs ([[mode, steps], …] and [[k, steps], …], in step order; AR
  steps have no k entry, so the k log pairs with the speculative runs in turn)."""
  ks = [list(x) for x in k_log]
  total = {}
  for mode, n in mode_log:
    if mode == Mode.AR:
      total[("ar", 0)] = total.get(("ar", 0), 0) + n
      continue
    while n > 0 and ks:
      k, m = ks[0]
      used = min(n, m)
      total[(mode, k)] = total.get((mode, k), 0) + used
      n -= used
      ks[0][1] -= used
      if ks[0][1] == 0:
        ks.pop(0)
  return [[m, k, n] for (m, k), n in total.items()]


def _label(mode: str, k: int) -> str:
  return f"{mode}:{k}" if k else mode


def markdown(result: dict) -> str:
  """Three tables: throughput (decode-only × AR, end-to-end in parentheses), τ,
  and flex's cost model against what the fixed settings measured."""
  names = [s["name"] for s in result["settings"]]
  flex = next((s["name"] for s in result["settings"] if s["mode"] == Mode.FLEX), None)
  others = [n for n in names if n not in ("ar", flex)]
  rows = [r for r in result["results"] if "skipped" not in r]
  skipped = [str(r["batch_size"]) for r in result["results"] if "skipped" in r]
  temp = result.get("temperature", 0.0)
  out = [f"Decode tokens/s (median of up to {result['repeats']} timed rounds, "
         f"{result['max_new_tokens']} new tokens per row, attention {result['attn_impl']}"
         + (f", sampled at T = {temp:g}, a seed per round" if temp else "")
         + (", argmax drafts" if temp and result.get("draft_sampling") is False else "") + "); "
         "× AR decode-only, end-to-end (prefill included) in parentheses.", ""]
  head = (["batch", "AR tok/s"] + [f"{n} tok/s (× AR)" for n in others]
          + (["flex tok/s", "flex × AR", "flex / best fixed"] if flex else []) + ["lossless"])
  out += [_md_row(head), _md_row(["---"] * len(head))]
  for r in rows:
    s = r["settings"]
    impl = r.get("attn_impl", result["attn_impl"])
    cells = [str(r["batch_size"]) + (f" ({impl})" if impl != result["attn_impl"] else ""),
             f"{s['ar']['median']:.1f}"]
    cells += [f"{s[n]['median']:.1f} ({s[n]['over_ar']:.2f}×, {s[n]['e2e_over_ar']:.2f}×)"
              for n in others]
    if flex:
      f = s[flex]
      best = (f"{r['flex_over_best_fixed']:.2f} ({r['best_fixed']})"
              if r.get("best_fixed") else "-")
      cells += [f"{f['median']:.1f}", f"{f['over_ar']:.2f}× ({f['e2e_over_ar']:.2f}×)", best]
    cells.append(_lossless_cell(r["lossless"]))
    out.append(_md_row(cells))
  out += ["", "τ (emitted tokens per verification; flex: overall, then per mode)", ""]
  head = ["batch"] + others + ([flex] if flex else [])
  out += [_md_row(head), _md_row(["---"] * len(head))]
  for r in rows:
    s = r["settings"]
    cells = [str(r["batch_size"])] + [f"{s[n]['tau']:.2f}" for n in others]
    if flex:
      per = ", ".join(f"{m} {t:.2f}" for m, t in s[flex]["mode_tau"].items())
      cells.append(f"{s[flex]['tau']:.2f}" + (f" ({per})" if per else ""))
    out.append(_md_row(cells))
  flexes = [s["name"] for s in result["settings"] if s["mode"] == Mode.FLEX]
  for flex in flexes:
    views = [r.get("flex_views", {flex: r.get("flex")}).get(flex) for r in rows]
    compared = [n for n in names if n not in ("ar", flex) and n in (
        views[0]["cost_model_vs_measured"] if rows and views[0] else {})]
    out += ["", f"{flex}: its cost model against measurement: its steps per (mode:k); the "
            "tokens/s it predicted for its own chunks / what they measured (chunks that "
            "compiled left out); and per setting the × AR it predicted over its run (each "
            "prediction weighed by the steps decoded on it) / the × AR measured.", ""]
    head = ["batch", "flex steps", "its chunks: predicted / measured tok/s"] + compared
    out += [_md_row(head), _md_row(["---"] * len(head))]
    for r, fv in zip(rows, views):
      steps = ", ".join(f"{_label(m, k)}×{n}" for m, k, n in fv["mode_k_steps"])
      own = ", ".join(f"{n} {c['predicted_tokens_per_s']:.1f} / "
                      f"{c['measured_tokens_per_s']:.1f}"
                      for n, c in fv.get("chunks", {}).items())
      cells = [str(r["batch_size"]), steps or "-", own or "-"]
      for n in compared:
        c = fv["cost_model_vs_measured"].get(n, {})
        p = c.get("predicted_over_ar")
        cells.append(f"{p:.2f} / {c['measured_over_ar']:.2f}" if p is not None
                     else f"- / {c.get('measured_over_ar', 0):.2f}")
      out.append(_md_row(cells))
  if skipped:
    out += ["", f"Skipped for the time budget: batch {', '.join(skipped)}."]
  return "\n".join(out) + "\n"


def _lossless_cell(lossless) -> str:
  """yes / NO, or "sampled" where outputs were not compared (T > 0)."""
  return "sampled" if lossless is None else ("yes" if lossless else "NO")


def _md_row(cells: Sequence[str]) -> str:
  return "| " + " | ".join(cells) + " |"


def load_drafter(path: str, target) -> tuple:
  """(Drafter, note): the drafter saved at `path` (relative: the cwd, then the
  repository), or for an empty `path` a randomly initialised one (2 draft
  layers, block 4) whose note says so — its τ and speedups mean nothing."""
  from flexdraft_jax.evaluation import plan, sweep
  if path:
    from flexdraft_jax import api
    return api.load_drafter(plan.resolve_path(path), target), ""
  config = sweep.default_config()
  config.drafter = ""
  config.random_drafter.update(dict(allow=True, num_layers=2, block_size=4, calib_rank=16))
  drafter, info = sweep.load_main_drafter(config, target)
  return drafter, info["note"]
