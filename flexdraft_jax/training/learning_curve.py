"""The drafter's learning curve: held-out τ and slot accuracy vs mask rows seen.

  python -m flexdraft_jax learning-curve --metrics=RUN/metrics.csv \
      [--out=docs/results/learning_curve]

Reads the eval rows of one or more training runs' metrics.csv (a run that
warm-started from another's drafter continues its `mask_rows`), plots offline
τ and slot 1..4 top-1 accuracy against mask rows on a log axis (OUT.png) and
writes OUT.md: the table (`--compare` overlays earlier runs' τ) and a log-linear fit of τ over the later half of the
points, with the mask rows it predicts for τ = 3, 4, 5 (an extrapolation, not a
promise: such curves bend). Rows that also scored the held-out questions in the
prompt variants' formats (`variant_eval_tau`: the benchmarks' instructions) add
that curve and a table column. Without `--out` the files go beside the last
`--metrics` file (RUN/learning_curve.png and .md); the command says where.
"""

from __future__ import annotations

import csv
import os

import numpy as np


def _rows(paths, column: str):
  """The metrics rows of `paths` that have `column` and mask_rows, oldest first."""
  for path in paths:
    with open(path) as f:
      yield from (r for r in csv.DictReader(f) if r.get(column) and r.get("mask_rows"))


def eval_points(paths) -> list:
  """[(mask_rows, tau, acc1..acc4)] over all eval rows, by mask rows."""
  pts = {int(float(r["mask_rows"])): (float(r["eval_tau"]), *(
      float(r[f"eval_acc_{j}"]) for j in range(1, 5))) for r in _rows(paths, "eval_tau")}
  return [(k, *v) for k, v in sorted(pts.items())]


def variant_points(paths, column: str = "variant_eval_tau") -> dict:
  """{mask_rows: column} over the eval rows that have it (variant_eval_tau,
  or blind_eval_tau: the held-out answers drafted as parallel mode drafts)."""
  return {int(float(r["mask_rows"])): float(r[column]) for r in _rows(paths, column)}


def fit(points) -> tuple:
  """(a, b) of τ ≈ a + b·log10(rows) over the later half of the points."""
  later = points[len(points) // 2:]
  if len(later) < 2:
    return None
  x = np.log10([p[0] for p in later])
  y = np.array([p[1] for p in later])
  b, a = np.polyfit(x, y, 1)
  return a, b


def write_curve(metrics: list, out: str, *, title: str = "SmolLM2-135M drafter",
                label: str = "held-out τ", compare=()) -> str:
  """Writes `out`.png and `out`.md from the eval rows of the `metrics` files;
  `compare` holds "LABEL=a.csv[+b.csv]" curves to overlay. Returns the table."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  from flexdraft_jax.model.config import FlexDraftError
  points = eval_points(metrics)
  if not points:
    raise FlexDraftError("no eval rows with mask_rows in " + ", ".join(metrics))
  rows = np.array([p[0] for p in points])
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  ax1.plot(rows, [p[1] for p in points], "o-", label=label)
  variants = variant_points(metrics)
  if variants:
    ax1.plot(list(variants), list(variants.values()), "^-",
             label="the same, the prompt variants' formats")
  blind = variant_points(metrics, "blind_eval_tau")
  if blind:
    ax1.plot(list(blind), list(blind.values()), "v-",
             label="the same, drafted blind (parallel mode)")
  for spec in compare:
    label, _, paths = spec.partition("=")
    other = eval_points(paths.split("+"))
    ax1.plot([p[0] for p in other], [p[1] for p in other], "s:", alpha=0.7, label=label)
  line = fit(points)
  if line and line[1] > 0:
    xs = np.logspace(np.log10(rows[0]), np.log10(rows[-1]) + 1, 50)
    ax1.plot(xs, line[0] + line[1] * np.log10(xs), "--", color="gray",
             label="log-linear fit (later half)")
  ax1.set_xscale("log")
  ax1.set_xlabel("mask rows seen")
  ax1.set_ylabel("offline τ")
  ax1.legend(loc="lower right", fontsize=6)  # the curves rise to the right
  for j in range(1, 5):
    ax2.plot(rows, [p[1 + j] for p in points], "o-", label=f"slot {j}")
  if rows[-1] > 10 * rows[0]:
    ax2.set_xscale("log")
  else:  # under a decade a log axis labels every minor tick in full
    ax2.xaxis.set_major_formatter(
        matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1e6:g} M"))
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(6))
  ax2.set_xlabel("mask rows seen")
  ax2.set_ylabel("top-1 accuracy")
  ax2.legend()
  fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out + ".png", dpi=110)

  lines = ["| mask rows | offline τ | acc 1 | acc 2 | acc 3 | acc 4 |",
           "|---|---|---|---|---|---|"]
  lines += [f"| {p[0]:,} | {p[1]:.3f} | " + " | ".join(f"{a:.3f}" for a in p[2:]) + " |"
            for p in points]
  # one more column each, blank where a row did not score them
  for extra, head in ((variants, "τ, prompt variants' formats"),
                      (blind, "τ drafted blind (parallel mode)")):
    if extra:
      cells = [f" {head} |", "---|"] + [
          f" {extra[p[0]]:.3f} |" if p[0] in extra else " |" for p in points]
      lines = [a + b for a, b in zip(lines, cells)]
  if line and line[1] > 0:
    a, b = line
    preds = ", ".join(f"τ = {t}: {10 ** ((t - a) / b):.2g} rows" for t in (3, 4, 5))
    lines += ["", f"Fit over the later half: τ ≈ {a:.3f} + {b:.3f}·log10(rows); "
              f"predicted {preds}."]
  elif line:
    lines += ["", "The later half of the curve is flat or falling: no prediction."]
  with open(out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  return "\n".join(lines)


def run(argv):
  """Entry from `python -m flexdraft_jax learning-curve`."""
  from absl import flags

  from flexdraft_jax import cli_util
  names = ("metrics", "out", "title", "label", "compare")
  for name in names:
    if name in flags.FLAGS:
      delattr(flags.FLAGS, name)
  flags.DEFINE_list("metrics", [], "(required) metrics.csv files, oldest run first")
  flags.DEFINE_string("out", "", "output path without suffix (default: learning_curve "
                      "beside the last --metrics file)")
  flags.DEFINE_string("title", "SmolLM2-135M drafter", "plot title")
  flags.DEFINE_string("label", "held-out τ", "legend label of --metrics' τ curve")
  flags.DEFINE_list("compare", [], "earlier runs' τ curves to overlay: LABEL=metrics.csv "
                    "(LABEL=a.csv+b.csv for a warm-started continuation)")
  FLAGS = flags.FLAGS

  def main(args):
    from flexdraft_jax.model.config import FlexDraftError
    if len(args) > 1:
      raise FlexDraftError(f"unexpected arguments: {' '.join(args[1:])}")
    if not FLAGS.metrics:
      raise FlexDraftError("--metrics is required")
    for path in FLAGS.metrics:
      if not os.path.isfile(path):
        raise FlexDraftError(f"--metrics: no file {path}")
    out = FLAGS.out or os.path.join(os.path.dirname(os.path.abspath(FLAGS.metrics[-1])),
                                    "learning_curve")
    print(write_curve(FLAGS.metrics, out, title=FLAGS.title, label=FLAGS.label,
                      compare=FLAGS.compare))
    print(f"learning-curve: wrote {os.path.abspath(out)}.png and .md", flush=True)

  cli_util.run_main(main, argv, doc=__doc__, key_flags=names)
