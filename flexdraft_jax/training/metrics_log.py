"""Training metrics to `metrics.csv` and TensorBoard scalars (tensorboardX, no TensorFlow)."""

from __future__ import annotations

import csv
import os

from tensorboardX import SummaryWriter


class MetricsLog:
  """Appends rows to WORKDIR/metrics.csv and scalars to a TensorBoard event file.

  On resume from step `resume_step`, CSV rows past it (written after the
  checkpoint) are dropped, so the log matches an uninterrupted run.
  """

  def __init__(self, workdir: str, columns: list, *, enabled: bool = True,
               resume_step: int = 0):
    self.enabled, self.columns = enabled, columns
    if not enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.csv")
    kept = []
    if resume_step and os.path.exists(self.path):
      with open(self.path, newline="") as f:
        kept = [r for r in csv.DictReader(f) if _whole(r) and int(r["step"]) <= resume_step]
    with open(self.path, "w", newline="") as f:
      w = csv.DictWriter(f, columns, extrasaction="ignore")
      w.writeheader()
      w.writerows(kept)
    self._tb = SummaryWriter(logdir=workdir)

  def write(self, step: int, row: dict) -> None:
    if not self.enabled:
      return
    row = dict(row, step=step)
    with open(self.path, "a", newline="") as f:
      csv.DictWriter(f, self.columns, extrasaction="ignore").writerow(
          {k: _fmt(row.get(k)) for k in self.columns})
    for k, v in row.items():
      if k != "step" and isinstance(v, (int, float)):
        self._tb.add_scalar(k, float(v), step)
    self._tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._tb.close()


def _whole(row: dict) -> bool:
  """A row written to its end (a killed run may leave its last line cut)."""
  return None not in row and None not in row.values() and row.get("step", "").isdigit()


def _fmt(v):
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.6g}"
  return v
