"""Sweep results -> results.csv, results.md (+ the ablation table) and PNG plots.

Everything here reads the `results.json` structure written by sweep.py; speedup
is derived, never stored: cell tokens/s ÷ tokens/s of the AR cell with the same
dataset, batch size and temperature (= AR time per token ÷ the cell's, SPEC §5).
"""

from __future__ import annotations

import csv
import os

import numpy as np

from flexdraft_jax.evaluation.cells import Cell
from flexdraft_jax.util import ceil_div

MODE_ORDER = ("ar", "parallel", "parallel_sel", "sequential", "flex")
CSV_FIELDS = ("dataset", "batch_size", "mode", "theta", "temperature", "drafter",
              "n_prompts", "new_tokens", "decode_seconds", "prefill_seconds",
              "tokens_per_second", "tau", "speedup", "speedup_e2e", "lossless", "steps",
              "mean_groups", "timing_runs", "accept_hist", "mode_tau")


def mode_label(mode: str, theta: float) -> str:
  if mode == "parallel_sel":
    return f"parallel selective θ={theta:g}"
  if mode == "parallel":
    return "parallel θ=0"
  return mode


def rows(results: dict) -> list:
  """One flat dict per cell, with `speedup` (None without an AR cell)."""
  cells = results["cells"]
  out = []
  for key, c in cells.items():
    p = c["params"]
    ar = cells.get(Cell(**p).ar_key)
    speedup = (c["tokens_per_second"] / ar["tokens_per_second"]
               if ar and ar["tokens_per_second"] > 0 else None)
    # end to end: prefill included (each row's first token is the prefill's)
    e2e = lambda x: x["new_tokens"] / max(x["decode_seconds"] + x.get("prefill_seconds", 0.0),
                                          1e-9)
    speedup_e2e = e2e(c) / e2e(ar) if ar and ar["new_tokens"] else None
    out.append({**p, "key": key, "label": mode_label(p["mode"], p["theta"]),
                "n_prompts": c["n_prompts"], "new_tokens": c["new_tokens"],
                "decode_seconds": c["decode_seconds"],
                "prefill_seconds": c.get("prefill_seconds"),
                "tokens_per_second": c["tokens_per_second"], "tau": c["tau"],
                "speedup": speedup, "speedup_e2e": speedup_e2e,
                "mode_tau": c.get("mode_tau") or {},
                "lossless": c["lossless"], "steps": c["steps"],
                "mean_groups": c.get("mean_groups"), "timing_runs": c["timing_runs"],
                "accept_hist": c["accept_hist"]})
  order = {m: i for i, m in enumerate(MODE_ORDER)}
  out.sort(key=lambda r: (r["dataset"], r["temperature"], r["batch_size"], r["drafter"] != "-",
                          r["drafter"], order.get(r["mode"], 99)))
  return out


def _fmt(x, spec=".2f") -> str:
  if x is None:
    return "n/a"
  if isinstance(x, bool):
    return "yes" if x else "NO"
  return format(x, spec)


def write_csv(results: dict, path: str) -> str:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for r in rows(results):
      w.writerow({**r, "accept_hist": " ".join(map(str, r["accept_hist"])),
                  "mode_tau": " ".join(f"{m}:{t:.3f}" for m, t in r["mode_tau"].items()),
                  "lossless": "" if r["lossless"] is None else r["lossless"]})
  return path


def _main_rows(results: dict) -> list:
  return [r for r in rows(results) if r["drafter"] in ("-", "main")]


def speedup_table(results: dict, temperature: float) -> list:
  """Markdown lines: (dataset, batch) × speculative mode, 'decode speedup× /
  end-to-end speedup× (τ)', + the mean."""
  rs = [r for r in _main_rows(results) if r["temperature"] == temperature]
  modes = [m for m in MODE_ORDER[1:] if any(r["mode"] == m for r in rs)]
  if not modes:
    return []
  theta = {r["mode"]: r["theta"] for r in rs}
  head = ["dataset", "batch", "AR tok/s"] + [mode_label(m, theta[m]) for m in modes]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  groups = sorted({(r["dataset"], r["batch_size"]) for r in rs})
  ar_tps = {(r["dataset"], r["batch_size"]): r["tokens_per_second"]
            for r in rs if r["mode"] == "ar"}
  for ds, bs in groups:
    cells = [_fmt(ar_tps.get((ds, bs)), ".1f")]
    for m in modes:
      r = next((r for r in rs if (r["dataset"], r["batch_size"], r["mode"]) == (ds, bs, m)), None)
      cells.append("" if r is None else
                   f"{_fmt(r['speedup'])}× / {_fmt(r['speedup_e2e'])}× ({r['tau']:.2f})"
                   + ("" if r["lossless"] in (True, None) else " **lossy**"))
    lines.append(f"| {ds} | {bs} | " + " | ".join(cells) + " |")
  for bs in sorted({b for _, b in groups}):
    ar = [v for (_, b), v in ar_tps.items() if b == bs]
    means = [f"{np.mean(ar):.1f}" if ar else ""]
    for m in modes:
      at = [r for r in rs if r["mode"] == m and r["batch_size"] == bs]
      sp = [r["speedup"] for r in at if r["speedup"] is not None]
      e2e = [r["speedup_e2e"] for r in at if r["speedup_e2e"] is not None]
      tau = [r["tau"] for r in at]
      means.append(f"{np.mean(sp):.2f}× / {np.mean(e2e):.2f}× ({np.mean(tau):.2f})"
                   if sp else "")
    lines.append(f"| **mean** | {bs} | " + " | ".join(means) + " |")
  return lines


def ablation_table(results: dict) -> list:
  """Markdown lines: one row per ablation variant and batch size, means over
  its datasets."""
  by_key = {r["key"]: r for r in rows(results)}
  st = results.get("ablation_settings", {})
  lines = [f"Datasets: {', '.join(st.get('datasets', []))}; T=0; τ (emitted tokens per "
           "verification), tokens/s and speedups (decode only / end to end, prefill "
           "included) are means over the datasets.", "",
           "| variant | batch | mode | τ | tok/s | speedup | e2e speedup | lossless | note |",
           "|---|---|---|---|---|---|---|---|---|"]
  for row in results.get("ablation", []):
    rs = [by_key[k] for k in row["cells"] if k in by_key]
    if not rs:
      lines.append(f"| {row['name']} | | | | | | | | {row['note'] or 'not run'} |")
      continue
    for bs in sorted({r["batch_size"] for r in rs}):
      at = [r for r in rs if r["batch_size"] == bs]
      sp = [r["speedup"] for r in at if r["speedup"] is not None]
      e2e = [r["speedup_e2e"] for r in at if r["speedup_e2e"] is not None]
      lossless = [r["lossless"] for r in at if r["lossless"] is not None]
      lines.append(
          f"| {row['name']} | {bs} | {at[0]['label']} | "
          f"{np.mean([r['tau'] for r in at]):.2f} | "
          f"{np.mean([r['tokens_per_second'] for r in at]):.1f} | "
          f"{(f'{np.mean(sp):.2f}×' if sp else 'n/a')} | "
          f"{(f'{np.mean(e2e):.2f}×' if e2e else 'n/a')} | "
          f"{_fmt(all(lossless)) if lossless else 'n/a'} | {row['note']} |")
  return lines


def ablation_by_dataset(results: dict) -> list:
  """Markdown lines: per batch size, one row per ablation variant and one
  column per dataset, each cell `τ / decode speedup× (end-to-end speedup×)`;
  a variant or cell that did not run reads "—"."""
  by_key = {r["key"]: r for r in rows(results)}
  datasets = results.get("ablation_settings", {}).get("datasets", [])
  batch_sizes = sorted({by_key[k]["batch_size"] for row in results.get("ablation", [])
                        for k in row["cells"] if k in by_key})
  lines = []
  for bs in batch_sizes:
    lines += [f"Batch {bs}: `τ / decode speedup× (end-to-end speedup×)`", "",
              "| variant | mode | " + " | ".join(datasets) + " |",
              "|---|---|" + "---|" * len(datasets)]
    for row in results.get("ablation", []):
      at = {by_key[k]["dataset"]: by_key[k] for k in row["cells"]
            if k in by_key and by_key[k]["batch_size"] == bs}
      label = next(iter(at.values()))["label"] if at else ""
      cells = ["—" if (r := at.get(d)) is None else
               f"{r['tau']:.2f} / {_times(r['speedup'])} ({_times(r['speedup_e2e'])})"
               for d in datasets]
      lines.append(f"| {row['name']} | {label} | " + " | ".join(cells) + " |")
    lines.append("")
  return lines


def _times(x) -> str:
  return "n/a" if x is None else f"{x:.2f}×"


def _batches_note(settings: dict) -> str:
  cap = settings.get("batches_per_cell") or 0
  return (f", at most {cap} batch{'es' if cap > 1 else ''} per cell (batch b runs "
          f"the first {cap}·b)" if cap > 0 else "")


def step_cost_table(results: dict) -> list:
  """Flex `auto`'s seconds per step at each batch shape: AR and each mode at
  each verify length k (the shortest and longest measured, the rest
  interpolated, marked ~), and the τ at which each would match AR."""
  costs = {}
  for c in results["cells"].values():
    if c["params"]["mode"] == "flex":
      costs.update(c.get("step_costs", {}))
  if not costs:
    return []
  # A bonus-input drafter has no parallel mode: only the modes some shape timed.
  modes = [m for m in ("sequential", "parallel") if any(m in c for c in costs.values())]
  ks = sorted({k for c in costs.values() for m in modes for k in c.get(m, {})}, key=int)
  cols = [(m, k) for m in modes for k in ks]
  lines = ["| rows | ar | " + " | ".join(f"{m} k={k}" for m, k in cols) + " |",
           "|---|---|" + "---|" * len(cols)]
  for rows_ in sorted(costs, key=int):
    c = costs[rows_]
    measured = {str(k) for k in c.get("measured_k", [])}
    def cell(m, k):
      t = c.get(m, {}).get(k)
      if t is None:
        return "-"
      mark = "" if k in measured else "~"
      return f"{mark}{1e3 * t:.1f} ms (τ {t / c['ar']:.2f})"
    lines.append(f"| {rows_} | {1e3 * c['ar']:.1f} ms | "
                 + " | ".join(cell(m, k) for m, k in cols) + " |")
  return lines


def write_markdown(results: dict, path: str, plots: list) -> str:
  meta = results.get("meta", {})
  drafter = meta.get("drafter", {})
  st = meta.get("settings", {})
  lines = [f"# FlexDraft sweep: {meta.get('target')}", ""]
  if drafter.get("note"):
    lines += [f"> **WARNING: {drafter['note']}**", ""]
  if results.get("skipped_cells"):
    lines += [f"> **{len(results['skipped_cells'])} cells were skipped** (see \"Skipped "
              "cells\" below).", ""]
  lines += [f"Drafter: {drafter.get('kind')} {drafter.get('path', '')} "
            f"(L={drafter.get('config', {}).get('num_layers')}, "
            f"bs={drafter.get('config', {}).get('block_size')}). "
            f"max_new_tokens={st.get('max_new_tokens')}, prompts per dataset: "
            f"{st.get('limit') if (st.get('limit') or 0) > 0 else 'all'} (the first of each "
            f"file){_batches_note(st)}, seed {st.get('seed')}, "
            f"target in {st.get('dtype', '(dtype not recorded)')}. "
            + ("Warmed up. " if st.get("warmup", True) else "No warm-up run (a timed "
               "run that compiled is timed again). ")
            + "Speedup = AR time per output token ÷ the mode's (same prompts, batch size "
            "and temperature): decode only, then end to end (prefill included). τ = "
            "emitted tokens per verification.", ""]
  all_rows = rows(results)
  for temp in sorted({r["temperature"] for r in all_rows}):
    table = speedup_table(results, temp)
    if table:
      lines += [f"## Speedup over AR, T={temp:g} — `decode speedup× / end-to-end "
                "speedup× (τ)`", ""] + table + [""]
  lines += ["## All cells", "",
            "| dataset | batch | T | mode | drafter | τ | tok/s | speedup | lossless | "
            "accepted tokens per step (1, 2, …) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for r in all_rows:
    hist = r["accept_hist"][1:] if r["mode"] != "ar" else r["accept_hist"][1:2]
    lines.append(f"| {r['dataset']} | {r['batch_size']} | {r['temperature']:g} | "
                 f"{r['label']} | {r['drafter']} | {r['tau']:.2f} | "
                 f"{r['tokens_per_second']:.1f} | {_fmt(r['speedup'])} | "
                 f"{_fmt(r['lossless'])} | {' '.join(map(str, hist))} |")
  skipped = results.get("skipped_cells") or {}
  if skipped:
    lines += ["", "## Skipped cells", "",
              f"{len(skipped)} cells of the plan did not run:", "",
              "| cell | why |", "|---|---|"]
    lines += [f"| {key} | {why.removeprefix('skipped: ')} |"
              for key, why in sorted(skipped.items())]
  costs = step_cost_table(results)
  if costs:
    lines += ["", "## Flex `auto`: measured step costs", "",
              "Seconds per step of each mode and verify length k at each live batch "
              "shape (cached per target/drafter/hardware/shape; ~ interpolated between "
              "the measured k). Flex predicts tokens/s = τ(k) / cost and runs the "
              "fastest; in brackets, the τ at which that step matches AR.", ""] + costs
  if results.get("ablation"):
    lines += ["", "## Ablations", ""] + ablation_table(results)
    lines += ["", "### By dataset", ""] + ablation_by_dataset(results)
  if plots:
    lines += ["", "## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})"
                                     for p in plots]
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
  return path


# ---------------------------------------------------------------- plots ----

def _figure(n_panels: int, width: float = 4.0, height: float = 3.2):
  """A Figure on the Agg canvas (no pyplot: safe inside notebooks and servers)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  cols = min(n_panels, 3)
  nrows = ceil_div(n_panels, cols)
  fig = Figure(figsize=(width * cols, height * nrows), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(nrows, cols, squeeze=False).ravel()
  for ax in axes[n_panels:]:
    ax.set_visible(False)
  return fig, axes


def plot_speedup_vs_batch(results: dict, workdir: str) -> list:
  paths = []
  main = [r for r in _main_rows(results) if r["mode"] != "ar" and r["speedup"] is not None]
  for temp in sorted({r["temperature"] for r in main}):
    rs = [r for r in main if r["temperature"] == temp]
    datasets = sorted({r["dataset"] for r in rs})
    all_bs = sorted({r["batch_size"] for r in rs})
    fig, axes = _figure(len(datasets) + 1)
    for ax, ds in zip(axes, datasets + ["mean over datasets"]):
      for m in MODE_ORDER[1:]:
        mr = [r for r in rs if r["mode"] == m and (ds.startswith("mean") or r["dataset"] == ds)]
        if not mr:
          continue
        bss = sorted({r["batch_size"] for r in mr})
        ys = [np.mean([r["speedup"] for r in mr if r["batch_size"] == b]) for b in bss]
        ax.plot(bss, ys, marker="o", label=mr[0]["label"])
      ax.axhline(1.0, color="gray", lw=0.8, ls="--")
      ax.set_xscale("log", base=2)
      ax.set_xticks(all_bs, [str(b) for b in all_bs])
      ax.minorticks_off()
      ax.set_title(ds)
      ax.set_xlabel("batch size")
      ax.set_ylabel("speedup over AR")
      ax.legend(fontsize=7)
    fig.suptitle(f"Speedup vs batch size (T={temp:g})")
    paths.append(os.path.join(workdir, f"speedup_vs_batch_T{temp:g}.png"))
    fig.savefig(paths[-1], dpi=90)
  return paths


def plot_tau(results: dict, workdir: str) -> list:
  rs = [r for r in _main_rows(results) if r["mode"] != "ar"]
  if not rs:
    return []
  temp, bs = min(r["temperature"] for r in rs), min(r["batch_size"] for r in rs)
  rs = [r for r in rs if r["temperature"] == temp and r["batch_size"] == bs]
  datasets = sorted({r["dataset"] for r in rs})
  modes = [m for m in MODE_ORDER[1:] if any(r["mode"] == m for r in rs)]
  fig, (ax,) = _figure(1, width=max(5.0, 1.4 * len(datasets)), height=3.5)
  w = 0.8 / max(len(modes), 1)
  for k, m in enumerate(modes):
    ys = [next((r["tau"] for r in rs if r["dataset"] == d and r["mode"] == m), 0.0)
          for d in datasets]
    ax.bar(np.arange(len(datasets)) + k * w, ys, w,
           label=next(r["label"] for r in rs if r["mode"] == m))
  ax.set_xticks(np.arange(len(datasets)) + w * (len(modes) - 1) / 2, datasets)
  ax.set_ylabel("τ (tokens per verification)")
  ax.set_title(f"τ per dataset (batch {bs}, T={temp:g})")
  # below the axes: inside, it covers the bars of the last dataset
  ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(modes))
  path = os.path.join(workdir, "tau_per_dataset.png")
  fig.savefig(path, dpi=90, bbox_inches="tight")
  return [path]


def plot_accept_hist(results: dict, workdir: str) -> list:
  rs = [r for r in _main_rows(results) if r["mode"] != "ar"]
  if not rs:
    return []
  temp, bs = min(r["temperature"] for r in rs), min(r["batch_size"] for r in rs)
  rs = [r for r in rs if r["temperature"] == temp and r["batch_size"] == bs]
  modes = [m for m in MODE_ORDER[1:] if any(r["mode"] == m for r in rs)]
  from matplotlib.ticker import MaxNLocator
  fig, axes = _figure(len(modes))
  for ax, m in zip(axes, modes):
    for r in (r for r in rs if r["mode"] == m):
      h = np.asarray(r["accept_hist"], float)
      if h.sum() == 0:
        continue
      ax.plot(np.arange(1, len(h)), h[1:] / h.sum(), marker=".", label=r["dataset"])
    ax.set_title(next(r["label"] for r in rs if r["mode"] == m))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tokens committed per step")
    ax.set_ylabel("fraction of steps")
    ax.legend(fontsize=7)
  fig.suptitle(f"Accepted-length histograms (batch {bs}, T={temp:g})")
  path = os.path.join(workdir, "accept_hist.png")
  fig.savefig(path, dpi=90)
  return [path]


def write_all(results: dict, workdir: str) -> list:
  """Writes results.csv, the plots and results.md; returns their paths."""
  plots = (plot_speedup_vs_batch(results, workdir) + plot_tau(results, workdir)
           + plot_accept_hist(results, workdir))
  return [write_csv(results, os.path.join(workdir, "results.csv"))] + plots + [
      write_markdown(results, os.path.join(workdir, "results.md"), plots)]
