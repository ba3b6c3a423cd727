"""Flex's step-cost model: what each kind of decoding step costs at a batch shape.

Flex (flex.py) predicts tokens/s = τ(k) / cost(mode, k) for AR and every
speculative (mode, k). The costs come from here: for this target, drafter,
hardware and batch shape `measure` times the steps once (AR, and each
speculative mode at the shortest and longest k; lengths between are
interpolated), keyed by everything a step's cost depends on (`cost_key`).
What the chunks then really cost corrects the model: per (mode, k) once it has
run `MIN_TIMED` steps, else per mode, the ratio of the seconds the decoding
chunks took to what the measured costs predicted scales those costs
(`cost_scale`), so a mode slower than timed falls back to AR at the next choice
(a mode that has not run lately borrows the others' ratio, up to
`MACHINE_DRIFT`: a busy machine slows every mode; where speculation would win
only by AR's borrowed slowdown, `MIN_TIMED` AR steps first tell whether AR
slowed down too); where they ran more than `RETIME` off, the timing itself was
off and flex times the steps again (once per batch shape and run).
Per batch shape it also keeps what flex predicted for the chunks it ran against
what they measured (`chunk_record`, reported by flex's `stats()`).
The measured costs are kept in a JSON file (step_costs.py) and in memory.
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from flexdraft_jax.decoding import step_costs
from flexdraft_jax.decoding.options import TREE, Mode
from flexdraft_jax.drafter.model import narrowed_dtype
from flexdraft_jax.kernels import cpu_matmul

# Decoding steps of a mode before their wall time corrects its costs (and before
# its chunks grow from probes to full length): two probe chunks.
MIN_TIMED = 8
TIMING_ROUNDS = 3  # rounds of timing every variant (measure)
# Part of the step-cost cache key: bump it when a change to the decode step
# changes what a step costs, so costs timed before it are timed again
# (2: the transposed decode layout and buckets 2, 3, 4, 8, 16, 2026-12-02;
# 3: the CPU kernel's blocking by ISA, and the key names its build, 2026-12-07).
STEP_COST_VERSION = 3
# Where a mode's decoding chunks (RETIME_STEPS of them at least) ran more than
# RETIME times slower or faster than its timed costs predicted, the timing
# itself was off — a busy spell of a shared CPU while `measure` ran (it skews
# the two timed lengths apart, and the interpolation between them inherits
# it), or a cached table from other conditions: flex times the steps again,
# once per batch shape and run. (On a quiet machine the corrections stay
# within a few %: 0.995 and 1.023 in two batch-1 runs here.)
RETIME = 1.25
RETIME_STEPS = 2 * MIN_TIMED
# How much slower (or faster) than timed a shared CPU may run all modes at
# once: a mode that has not run since inherits the others' correction up to
# this factor; beyond it the slowdown is the mode's own (cost_scale).
MACHINE_DRIFT = 1.5


def chunk_record(steps: int, predicted: float, tokens: int, seconds: float) -> dict:
  """What flex predicted for the `steps` decoding steps of one (mode, k) (tokens/s,
  weighed by steps) against what they measured (`tokens` in `seconds`)."""
  return {"steps": steps, "predicted_tokens_per_s": round(predicted, 2),
          "measured_tokens_per_s": round(tokens / seconds, 2),
          "tokens": tokens, "seconds": round(seconds, 4)}


def merge_chunk_records(records) -> dict:
  """The chunk records (`chunk_record`, by (mode, k) name) of several batches of
  one shape, summed: steps, tokens and seconds add up, the prediction is
  weighed by steps."""
  acc = {}
  for rec in records:
    for name, r in rec.items():
      a = acc.setdefault(name, [0, 0.0, 0, 0.0])
      a[0] += r["steps"]
      a[1] += r["steps"] * r["predicted_tokens_per_s"]
      a[2] += r["tokens"]
      a[3] += r["seconds"]
  return {name: chunk_record(w, t / w, tok, sec) for name, (w, t, tok, sec) in acc.items()}


class StepCosts:
  """The kinds of step flex weighs (`families`) and what each costs per batch
  shape: timed, cached, and corrected by what the decoding chunks took.

  `time_step(state, mode, k)` runs one full step of (mode, k) on a copy of
  `state` and returns its seconds (the driver owns the jitted chunk).
  """

  def __init__(self, target, drafter, opts, buckets, time_step, parallel_drafter=None,
               tree_budgets: tuple = ()):
    self.target, self.drafter, self.opts = target, drafter, opts
    self.buckets, self.time_step = buckets, time_step
    self.parallel_drafter = parallel_drafter
    # Draft trees (`tree_budget`): sequential steps verifying a tree of N nodes
    # compete as (TREE, N).
    self.tree_budgets = tree_budgets
    # Parallel mode drafts in the verify forward, before the bonus is known:
    # only with a drafter trained to draft so (DrafterConfig.drafts_blind), or
    # a parallel drafter of its own.
    self.modes = ((Mode.SEQUENTIAL, Mode.PARALLEL)
                  if drafter.config.drafts_blind or parallel_drafter is not None
                  else (Mode.SEQUENTIAL,))
    self.costs = None              # step costs at the current batch shape
    self.cost_path = step_costs.cost_cache_path(getattr(opts, "cost_cache", "default"))
    self.measured = {}             # batch rows -> step costs ("auto")
    self.retimed = set()           # batch rows whose costs were timed again
    # Batch rows -> {(mode, k): [steps, seconds, tokens]} of decoding chunks
    # during which nothing compiled.
    self.realized = {}
    # Batch rows -> {(mode, k): [Σ steps · predicted tokens/s, Σ steps]} of the
    # chunks that ran on each choice (compiling ones left out, as in `realized`).
    self.predicted_chunks = {}
    self.timing_spans = []         # (start, end) wall time of step-cost measurements

  @property
  def families(self) -> tuple:
    """Every speculative kind of step with its lengths k: the modes with the
    verify lengths, and draft trees (TREE) with their budgets."""
    return tuple((m, self.buckets) for m in self.modes) + (
        ((TREE, self.tree_budgets),) if self.tree_budgets else ())

  def shape_changed(self):
    self.costs = None  # step costs depend on the batch

  def time_if_needed(self, state, B: int, S: int):
    """Times the steps at B rows where this shape has no costs yet, or again
    where decoding ran off them (`timing_was_off`)."""
    if self.costs is None:
      self.costs = self.measured[str(B)] = self.measure(state, B, S)
    elif self.timing_was_off(B):
      self.retimed.add(B)
      self.realized.pop(B, None)  # corrections of the old costs
      self.costs = self.measured[str(B)] = self.measure(state, B, S, again=True)

  def observe(self, B: int, mode: str, k: int, steps: int, seconds: float, tokens: int,
              predicted=None):
    """A decoding chunk at (mode, k) on B rows during which nothing compiled:
    `tokens` in `steps` steps and `seconds` of wall time; `predicted` is the
    tokens/s flex predicted for it where it ran on the choice that made it."""
    if predicted is not None:
      acc = self.predicted_chunks.setdefault(B, {}).setdefault((mode, k), [0.0, 0])
      acc[0] += steps * predicted
      acc[1] += steps
    row = self.realized.setdefault(B, {}).setdefault((mode, k), [0, 0.0, 0])
    row[0] += steps
    row[1] += seconds
    row[2] += tokens

  def timed_steps(self, B: int, mode: str) -> int:
    """The steps of `mode`'s decoding chunks at B, at any k: its costs at other
    k are interpolated and share its correction (cost_scale)."""
    return sum(r[0] for (m, _), r in self.realized.get(B, {}).items() if m == mode)

  def borrows(self, B: int, mode: str) -> bool:
    """Whether `mode` has under MIN_TIMED steps of its own at B, so that its
    correction is the other modes' (cost_scale)."""
    return self._realized_ratio(B, lambda m, kk: m == mode) is None

  def seconds(self, B: int, mode: str, k: int = 0) -> float:
    """Predicted seconds of one step of (mode, k) at B rows: its timed cost,
    corrected by what the chunks took (cost_scale)."""
    return self._cost(mode, k) * self.cost_scale(B, mode, k)

  def cost_scale(self, B: int, mode: str, k: int = 0) -> float:
    """Seconds the decoding chunks of `mode` took over what the step costs
    predicted for them: those at verify length `k` where it has MIN_TIMED
    steps at B (its timed or interpolated cost may be off by itself: two
    lengths of one mode are timed, each in a few steps), else all of the
    mode's. A mode with fewer than MIN_TIMED such steps borrows the other
    modes' ratio clipped to [1 / MACHINE_DRIFT, MACHINE_DRIFT] — the machine
    runs slower or faster now than when the costs were timed, for every mode
    alike — and 1 where no mode has any."""
    if self.costs is None:
      return 1.0
    if k:
      own = self._realized_ratio(B, lambda m, kk: (m, kk) == (mode, k))
      if own is not None:
        return own
    own = self._realized_ratio(B, lambda m, kk: m == mode)
    if own is not None:
      return own
    other = self._realized_ratio(B, lambda m, kk: m != mode)
    if other is None:
      return 1.0
    return float(np.clip(other, 1.0 / MACHINE_DRIFT, MACHINE_DRIFT))

  def timing_was_off(self, B: int) -> bool:
    """Whether some mode's chunks at B ran beyond RETIME of its timed costs
    (over RETIME_STEPS steps) and B was not timed again yet (see RETIME)."""
    if B in self.retimed:
      return False
    for mode in (Mode.AR,) + tuple(m for m, _ in self.families):
      r = self._realized_ratio(B, lambda m, kk: m == mode, RETIME_STEPS)
      if r is not None and not 1.0 / RETIME <= r <= RETIME:
        return True
    return False

  def _realized_ratio(self, B: int, pick, min_steps: int = MIN_TIMED):
    """Realized / predicted seconds of the chunks at B whose (mode, k) `pick`
    selects; None under `min_steps` steps."""
    rows = [(m, kk, r) for (m, kk), r in self.realized.get(B, {}).items() if pick(m, kk)]
    if sum(r[0] for _, _, r in rows) < min_steps:
      return None
    predicted = sum(r[0] * self._cost(m, kk) for m, kk, r in rows)
    return sum(r[1] for _, _, r in rows) / predicted

  def _cost(self, mode: str, k: int) -> float:
    return self.costs["ar"] if mode == Mode.AR else self.costs[mode][str(k)]

  def measured_rates(self, B: int, name) -> dict:
    """{`name(mode, k)`: tokens/s} the decoding chunks at B measured."""
    return {name(m, kk): round(r[2] / r[1], 2)
            for (m, kk), r in self.realized.get(B, {}).items() if r[1] > 0}

  def scales(self, B: int, name) -> dict:
    """`cost_scale` at B of each mode, and of each (mode, k) that ran there."""
    return {**{str(m): round(self.cost_scale(B, m), 3)
               for m in (Mode.AR,) + tuple(m for m, _ in self.families)},
            **{name(m, kk): round(self.cost_scale(B, m, kk), 3)
               for m, kk in self.realized.get(B, {}) if m != Mode.AR}}

  def chunk_records(self) -> dict:
    """Per batch shape, per (mode, k) that ran on a choice (by `mode:k`, or the
    mode at k = 0): its `chunk_record`."""
    name = lambda m, kk: f"{m}:{kk}" if kk else str(m)
    out = {}
    for b, acc in self.predicted_chunks.items():
      done = self.realized.get(b, {})
      out[b] = {name(m, kk): chunk_record(w, t / w, done[(m, kk)][2], done[(m, kk)][1])
                for (m, kk), (t, w) in acc.items()
                if w and done.get((m, kk), [0, 0])[1] > 0}
    return out

  def cost_key(self, B: int, S: int) -> str:
    dev = jax.devices()[0]
    d = self.drafter.config
    return "|".join(map(str, (
        f"v{STEP_COST_VERSION}", self.target.fingerprint, dev.platform, dev.device_kind,
        len(jax.devices()), jax.__version__, B, S, d.block_size, d.num_layers, d.draft_vocab,
        self.opts.threshold > 0, self.buckets, tuple(map(str, self.modes)),
        f"cpu_matmul {cpu_matmul.build_info()}" if cpu_matmul.available() else "dot",
        f"trees{self.tree_budgets}" if self.tree_budgets else "no_trees",
        narrowed_dtype(self.drafter.params) or "draft_dtype=target",
        f"rescore{d.rescore_top}" if d.rescores else "no_rescore",
        *self._parallel_key())))

  def _parallel_key(self) -> tuple:
    """The parallel drafter's part of the cost key (none without one)."""
    p = self.parallel_drafter
    if p is None:
      return ()
    d = p.config
    return ("parallel_drafter", d.num_layers, d.calib_rank,
            f"rescore{d.rescore_top}" if d.rescores else "no_rescore")

  def _nearest_length(self, table: dict, B: int, S: int):
    """The cache length nearest S whose costs at batch B (all else of the key
    alike) `table` holds, or None."""
    prefix, suffix = self.cost_key(B, "\0").split("\0")
    lengths = [int(k[len(prefix):len(k) - len(suffix)]) for k in table
               if k.startswith(prefix) and k.endswith(suffix)
               and k[len(prefix):len(k) - len(suffix)].isdigit()]
    return min(lengths, key=lambda s: (abs(s - S), -s)) if lengths else None

  def measure(self, state, B: int, S: int, again: bool = False) -> dict:
    """Seconds per step at this batch shape: AR, and each speculative mode at
    the shortest and longest verify length (the rest interpolated linearly in
    k). Cached in memory and, where possible, on disk; `again` times them
    anew (the cached ones were off, see RETIME) and replaces them."""
    key, table = self.cost_key(B, S), step_costs.read_costs(self.cost_path)
    if key in table and not again:
      return table[key]
    near = None if again else self._nearest_length(table, B, S)
    if near is not None:
      # Timing compiles every variant it times; the costs at another cache
      # length of this batch shape predict this one's first choice, and the
      # chunks correct them (or, RETIME off, have the steps timed after all).
      print(f"flex: step costs at batch {B} from the cache length {near} (this request's "
            f"{S} is not timed unless decoding runs off them)", file=sys.stderr, flush=True)
      return table[self.cost_key(B, near)]
    start = time.time()
    ends = {m: sorted({ks[0], ks[-1]}) for m, ks in self.families}
    plan = [(Mode.AR, 0)] + [(m, k) for m, _ in self.families for k in ends[m]]
    where = self.cost_path or "memory only"
    what = ("again: decoding ran off the timed costs" if again else "once")
    print(f"flex: timing {len(plan)} step variants at batch {B} {what} (kept in "
          f"{where})", file=sys.stderr, flush=True)
    import tqdm
    # Round-robin, best of TIMING_ROUNDS per variant: a slow spell of a shared
    # CPU then slows one round of every variant, not all rounds of one.
    timed = {v: float("inf") for v in plan}
    for _ in tqdm.trange(TIMING_ROUNDS, desc="flex step costs", leave=False,
                         disable=not sys.stderr.isatty()):
      for mode, k in plan:
        timed[(mode, k)] = min(timed[(mode, k)], self.time_step(state, mode, k))
    costs = {"ar": timed[(Mode.AR, 0)], "measured_k": ends[self.modes[0]]}
    for mode, ks in self.families:
      xs = np.array(ends[mode], float)
      ys = np.array([timed[(mode, k)] for k in ends[mode]])
      costs[mode] = {str(k): float(np.interp(k, xs, ys)) for k in ks}
    step_costs.write_costs(self.cost_path, {key: costs})  # merged into the file
    self.timing_spans.append((start, time.time()))  # not decoding: left out of its time
    return costs
