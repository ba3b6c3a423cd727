"""The host-side driver of every mode, and flex's choice between them.

Flex decoding (SPEC §2): parallel while the live batch is at or below `B*`,
sequential above it. With `B* = "auto"` the driver measures one step of each
candidate (ar, sequential, parallel at the needed group count) for this
target, hardware and batch shape once — cached on disk — and picks the mode
with the highest predicted tokens/s = τ_mode / t_mode (τ_ar = 1; the
speculative τ is the one observed so far, or the drafts' own confidence
before any step). Where neither speculative mode pays, that is plain AR.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

# Once at most half the rows of a batch of at least COMPACT_MIN are live, the
# live rows move to a smaller batch (a power of two, at least COMPACT_FLOOR),
# so finished rows stop costing compute.
COMPACT_MIN, COMPACT_FLOOR = 8, 4
AR_CHUNK = 32  # AR steps per device loop when the batch can still shrink

COST_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "flexdraft_jax",
                          "step_costs.json")


class Driver:
  """Runs chunks of jitted steps until every row is done."""

  def __init__(self, target, drafter, mode, opts, static, traced, B, S,
               steps_per_call=16, mesh=None):
    from flexdraft_jax.decoding import engine  # the jitted chunk lives there
    self.engine = engine
    self.target, self.drafter, self.mode, self.opts = target, drafter, mode, opts
    self.static, self.traced, self.B, self.S = static, traced, B, S
    self.steps_per_call = steps_per_call
    self.bs = drafter.config.block_size if drafter is not None else 1
    self.buckets = engine.group_buckets(self.bs, opts) if drafter else ()
    self.group_counts, self.modes = [], []
    self.costs = None
    self.ar_hist = 0               # the accept histogram's counts from flex's AR steps
    self.tau0 = None               # τ estimated from the first drafts' confidences
    self.measured = {}             # batch rows -> step costs (flex "auto")
    self.stale_drafts = False
    self.mesh = mesh
    self.row_ids = np.arange(B)   # original row of each state row
    self.outputs = {}             # original row -> tokens, for rows compacted away

  def _chunk(self, state, mode, groups, n_steps):
    refresh = self.stale_drafts and mode != "ar"
    self.stale_drafts = (self.stale_drafts or mode == "ar") and not refresh
    return self._call(state, mode, groups, n_steps, refresh)

  def _call(self, state, mode, groups, n_steps, refresh=False):
    dparams = None if self.drafter is None else self.drafter.params
    return self.engine.run_chunk(
        self.target.params, dparams, state, mode=mode, num_groups=groups,
        n_steps=jnp.int32(n_steps), theta=jnp.float32(self.opts.theta),
        strategy=self.opts.strategy, refresh=refresh, **self.static, **self.traced)

  def _bucket(self, needed: int) -> int:
    return next(g for g in self.buckets if g >= needed)

  def _needed(self, state):
    g, live = self.engine._needed_groups(state, theta=jnp.float32(self.opts.theta),
                                         strategy=self.opts.strategy)
    return int(g), int(live)

  def run(self, state, max_new: int):
    """Runs to the end; returns the final state (rows in `self.row_ids` order)."""
    steps = int(state.steps)
    while True:
      done = np.asarray(state.done_B)
      if done.all():
        return state
      state = self._maybe_compact(state, done)
      if self.mode == "ar" or self._sticky_ar():
        mode, g = "ar", 0
      else:
        groups, live = self._needed(state)
        mode = self._choose(state, live, groups)
        g = self._bucket(groups) if mode == "parallel" else 0
      if mode == "ar":
        # Plain AR runs exactly as the `ar` mode does: one device loop, or
        # chunks of AR_CHUNK while compaction can still shrink the batch.
        n = AR_CHUNK if self.B >= COMPACT_MIN else max_new
      else:
        selective = mode == "parallel" and self.opts.theta > 0
        n = 1 if selective else self.steps_per_call
      # τ must come from speculative steps only: flex keeps AR steps' counts
      # apart (AR chunks are few; speculative chunks pay no extra transfer).
      count_ar = self.mode == "flex" and mode == "ar"
      before = np.asarray(state.accept_hist) if count_ar else None
      state = self._chunk(state, mode, g, n)
      if count_ar:
        self.ar_hist = self.ar_hist + (np.asarray(state.accept_hist) - before)
      done_steps, steps = int(state.steps) - steps, int(state.steps)
      self._record(mode, g, done_steps)

  def _sticky_ar(self) -> bool:
    """Flex's AR choice stands until the batch shape changes: AR steps observe
    no τ and the step costs are per shape, so the prediction cannot change."""
    return (self.mode == "flex" and self.opts.flex_threshold == "auto"
            and self.costs is not None and bool(self.modes) and self.modes[-1][0] == "ar")

  def _maybe_compact(self, state, done):
    live = int((~done).sum())
    if self.B < COMPACT_MIN or live > self.B // 2:
      return state
    new_b = max(COMPACT_FLOOR, 1 << (live - 1).bit_length())
    if self.mesh is not None:
      new_b = -(-new_b // self.mesh.size) * self.mesh.size
    if new_b >= self.B:
      return state
    order = np.concatenate([np.flatnonzero(~done), np.flatnonzero(done)])
    keep, leave = order[:new_b], order[new_b:]
    out, n_out = np.asarray(state.out_BxO), np.asarray(state.n_out_B)
    for i in leave:
      self.outputs[int(self.row_ids[i])] = out[i, :n_out[i]].tolist()
    self.row_ids = self.row_ids[keep]
    state = take_rows(state, jax.numpy.asarray(keep, jax.numpy.int32))
    self.B, self.costs = new_b, None  # step costs depend on the batch
    return state

  def outputs_in_order(self, state, num_rows: int) -> list:
    """Every original row's tokens (rows compacted away included)."""
    out, n_out = np.asarray(state.out_BxO), np.asarray(state.n_out_B)
    found = dict(self.outputs)
    for i, r in enumerate(self.row_ids):
      found[int(r)] = out[i, :n_out[i]].tolist()
    return [found[r] for r in range(num_rows)]

  def _record(self, mode: str, groups: int, steps: int):
    """Run-length log of [mode, steps] and [group count, steps]."""
    for log, key in ((self.modes, mode), (self.group_counts, groups)):
      if key == 0:
        continue
      if log and log[-1][0] == key:
        log[-1][1] += steps
      else:
        log.append([key, steps])

  def _choose(self, state, live: int, groups: int) -> str:
    if self.mode != "flex":
      return self.mode
    if self.opts.flex_threshold != "auto":
      return "parallel" if live <= self.opts.flex_threshold else "sequential"
    if self.costs is None:
      self.costs = self.measured[str(self.B)] = self._measure(state)
    tau = self._tau(state)
    g = str(self._bucket(groups))
    rate = {"ar": 1.0 / self.costs["ar"],
            "sequential": tau / self.costs["sequential"],
            "parallel": tau / self.costs["parallel"][g]}
    return max(rate, key=rate.get)

  def _tau(self, state) -> float:
    """τ of the speculative steps so far; before four of them, the drafts' own
    estimate (1 + the sum of their cumulative confidences)."""
    hist = np.asarray(state.accept_hist) - self.ar_hist
    if hist.sum() >= 4:
      return float((hist * np.arange(len(hist))).sum() / hist.sum())
    if self.tau0 is None:  # from the prefill's drafts (AR steps leave them stale)
      conf = np.asarray(state.conf_BxD)
      self.tau0 = 1.0 + float(np.cumprod(conf, axis=1).sum(1).mean())
    return self.tau0

  def _cost_key(self) -> str:
    dev = jax.devices()[0]
    d = self.drafter.config
    return "|".join(map(str, (self.target.fingerprint, dev.platform, dev.device_kind,
                              len(jax.devices()), self.B, self.S, d.block_size,
                              d.num_layers, self.buckets)))

  def _measure(self, state) -> dict:
    """Seconds per step of each mode at this batch shape (cached on disk)."""
    key = self._cost_key()
    table = _read_costs()
    if key in table:
      return table[key]
    costs = {"ar": self._time(state, "ar", 0), "sequential": self._time(state, "sequential", 0),
             "parallel": {str(g): self._time(state, "parallel", g) for g in self.buckets}}
    table[key] = costs
    _write_costs(table)
    return costs

  def _time(self, state, mode, groups, reps: int = 3) -> float:
    probe = jax.tree.map(lambda x: x.copy(), state)

    def step(st):  # every row live, nothing emitted yet: one full step of work
      st = st._replace(done_B=jnp.zeros_like(st.done_B), n_out_B=jnp.zeros_like(st.n_out_B))
      return self._call(st, mode, groups, 1)

    for _ in range(2):  # compile + warm
      probe = step(probe)
    jax.block_until_ready(probe)
    t = time.perf_counter()
    for _ in range(reps):
      probe = step(probe)
    jax.block_until_ready(probe)
    return (time.perf_counter() - t) / reps

  def stats(self) -> dict:
    out = {"group_counts": self.group_counts, "mode_steps": self.modes}
    if self.mode == "flex":
      out["flex_threshold"] = self.opts.flex_threshold
      out["step_costs"] = self.measured
    return out


@jax.jit
def take_rows(state, idx_R):
  """The state of rows `idx_R` only (per-layer cache arrays are `[B, K, S, D]`)."""
  batch = lambda x: jnp.take(x, idx_R, axis=0)
  return state._replace(
      cache=jax.tree.map(batch, state.cache),
      length_B=batch(state.length_B), bonus_B=batch(state.bonus_B),
      drafts_BxD=batch(state.drafts_BxD), conf_BxD=batch(state.conf_BxD),
      q_BxDxV=batch(state.q_BxDxV), out_BxO=batch(state.out_BxO),
      n_out_B=batch(state.n_out_B), done_B=batch(state.done_B))


def _read_costs() -> dict:
  try:
    with open(COST_CACHE) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}


def _write_costs(table: dict):
  os.makedirs(os.path.dirname(COST_CACHE), exist_ok=True)
  tmp = COST_CACHE + ".tmp"
  with open(tmp, "w") as f:
    json.dump(table, f, indent=1)
  os.replace(tmp, COST_CACHE)
