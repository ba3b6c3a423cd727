"""The host-side driver of every mode, and flex's choice between them.

Flex decoding (SPEC §2, §7): parallel while the live batch is at or below `B*`,
sequential above it. With `B* = "auto"` the driver chooses a (mode, verify
length k) pair: for this target, drafter, hardware and batch shape it measures
step costs once (AR, and each speculative mode at the shortest and longest k;
lengths between are interpolated) and predicts tokens/s = τ(k) / cost(mode, k)
with τ(k) = 1 + Σ_{i<k} Π_{j≤i} r_j, r_j the acceptance rate of draft slot j
given the slots before it were accepted — counted from the steps run so far
where slot j was verified, and from the drafts' own confidences (scaled by how
well they have predicted acceptance) where it was not. AR competes with τ = 1;
where nothing beats it, that is plain AR. The measured costs are kept in a JSON
file (see `cost_cache_path`) and in memory.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

# Once at most half the rows of a batch of at least COMPACT_MIN are live, the
# live rows move to a smaller batch (a power of two, at least COMPACT_FLOOR),
# so finished rows stop costing compute.
COMPACT_MIN, COMPACT_FLOOR = 8, 4
AR_CHUNK = 32  # AR steps per device loop when the batch can still shrink
MIN_VERIFIED = 8  # row-steps of a draft slot before its own acceptance rate is used

# Measured step costs of this process: cache path -> {key: costs}.
_COSTS_IN_MEMORY: dict = {}
_WARNED: set = set()


def cost_cache_path(setting="default"):
  """Where flex keeps measured step costs: a path, or None (memory only).

  `setting` is `generate(cost_cache=...)`: "default" reads
  `$FLEXDRAFT_COST_CACHE` (a file; empty: memory only), else
  `$XDG_CACHE_HOME/flexdraft_jax/step_costs.json` (`~/.cache` without it).
  """
  if setting != "default":
    return setting or None
  env = os.environ.get("FLEXDRAFT_COST_CACHE")
  if env is not None:
    return env or None
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                           ".cache")
  return os.path.join(root, "flexdraft_jax", "step_costs.json")


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
    # Verify lengths k that get a compiled step (parallel: k groups).
    self.k_max = min(opts.verify_len or self.bs, self.bs)
    self.buckets = tuple(sorted({g for g in engine.group_buckets(self.bs, opts)
                                 if g <= self.k_max} | {self.k_max})) if drafter else ()
    self.group_counts, self.modes = [], []
    self.costs = None
    self.cost_path = cost_cache_path(getattr(opts, "cost_cache", "default"))
    self.ar_hist = 0               # the accept histogram's counts from flex's AR steps
    # Draft slot i (1-based): row-steps where it was verified / accepted.
    self.verified = np.zeros(self.bs, np.int64)
    self.accepted = np.zeros(self.bs, np.int64)
    self.choices = {}              # batch rows -> the last choice and its prediction
    self.measured = {}             # batch rows -> step costs (flex "auto")
    self.stale_drafts = False
    self.mesh = mesh
    self.row_ids = np.arange(B)   # original row of each state row
    self.outputs = {}             # original row -> tokens, for rows compacted away
    self.timing_spans = []        # (start, end) wall time of step-cost measurements

  def _chunk(self, state, mode, k, n_steps):
    refresh = self.stale_drafts and mode != "ar"
    self.stale_drafts = (self.stale_drafts or mode == "ar") and not refresh
    return self._call(state, mode, k, n_steps, refresh)

  def _call(self, state, mode, k, n_steps, refresh=False):
    dparams = None if self.drafter is None else self.drafter.params
    return self.engine.run_chunk(
        self.target.params, dparams, state, mode=mode, num_groups=k,
        n_steps=jnp.int32(n_steps), theta=jnp.float32(self.opts.theta),
        strategy=self.opts.strategy, refresh=refresh, **self.static, **self.traced)

  def _bucket(self, needed: int) -> int:
    return next((g for g in self.buckets if g >= needed), self.buckets[-1])

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
        mode, k = "ar", 0
      else:
        groups, live = self._needed(state)
        mode, k = self._choose(state, live, groups)
      selective = mode != "ar" and self.opts.theta > 0
      if mode == "ar":
        # Plain AR runs exactly as the `ar` mode does: one device loop, or
        # chunks of AR_CHUNK while compaction can still shrink the batch.
        n = AR_CHUNK if self.B >= COMPACT_MIN else max_new
      else:  # with θ > 0 the host picks the bucket every step
        n = 1 if selective else self.steps_per_call
      before = np.asarray(state.accept_hist) if self.mode == "flex" else None
      state = self._chunk(state, mode, k, n)
      if before is not None:
        delta = np.asarray(state.accept_hist) - before
        if mode == "ar":  # τ comes from speculative steps only
          self.ar_hist = self.ar_hist + delta
        else:
          self._count_acceptance(delta, k)
      done_steps, steps = int(state.steps) - steps, int(state.steps)
      self._record(mode, k, done_steps)

  def _count_acceptance(self, delta_hist, k: int):
    """Adds a chunk's accepted-length histogram (index a + 1) at verify length k."""
    a = np.arange(len(delta_hist)) - 1
    for i in range(1, k):
      self.verified[i] += int(delta_hist[a >= i - 1].sum())
      self.accepted[i] += int(delta_hist[a >= i].sum())

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

  def _record(self, mode: str, k: int, steps: int):
    """Run-length log of [mode, steps] and [verify length k, steps]."""
    for log, key in ((self.modes, mode), (self.group_counts, k)):
      if key == 0:
        continue
      if log and log[-1][0] == key:
        log[-1][1] += steps
      else:
        log.append([key, steps])

  def _choose(self, state, live: int, groups: int) -> tuple:
    """(mode, k) for the next chunk; `groups` is what selective verification
    asks for (k_max at θ = 0)."""
    k = self._bucket(min(groups, self.k_max)) if self.opts.theta > 0 else self.k_max
    if self.mode != "flex":
      return self.mode, k
    if self.opts.flex_threshold != "auto":
      return ("parallel" if live <= self.opts.flex_threshold else "sequential"), k
    if self.costs is None:
      self.costs = self.measured[str(self.B)] = self._measure(state)
    rates = self.predicted_rates(state)
    best = max(rates, key=rates.get)
    self.choices[str(self.B)] = {"choice": list(best), "tokens_per_s": {
        f"{m}:{kk}" if kk else m: round(r * self.B, 2) for (m, kk), r in rates.items()}}
    return best

  def predicted_rates(self, state) -> dict:
    """{(mode, k): predicted tokens per second per row} for AR and every bucket."""
    tau = self.tau_by_length(state)
    rates = {("ar", 0): 1.0 / self.costs["ar"]}
    for mode in ("sequential", "parallel"):
      for k in self.buckets:
        rates[(mode, k)] = tau[k] / self.costs[mode][str(k)]
    return rates

  def tau_by_length(self, state) -> dict:
    """{k: predicted τ(k)} from the per-slot acceptance rates (module doc)."""
    conf = np.asarray(state.conf_BxD, np.float64)
    live = ~np.asarray(state.done_B)
    c = np.concatenate([[1.0], conf[live].mean(0) if live.any() else conf.mean(0)])
    seen = self.verified >= MIN_VERIFIED
    # How well confidence has predicted acceptance where both are known.
    scale = 1.0
    if seen[1:].any():
      want = float((self.verified[seen] * c[seen]).sum())
      scale = float(np.clip(self.accepted[seen].sum() / max(want, 1e-9), 0.25, 4.0))
    r = np.where(seen, self.accepted / np.maximum(self.verified, 1),
                 np.clip(scale * c, 0.0, 1.0))
    survive = np.cumprod(r[1:])  # P(slots 1..i all accepted)
    return {k: 1.0 + float(survive[:k - 1].sum()) for k in self.buckets}

  def _cost_key(self) -> str:
    dev = jax.devices()[0]
    d = self.drafter.config
    return "|".join(map(str, (
        self.target.fingerprint, dev.platform, dev.device_kind, len(jax.devices()),
        jax.__version__, self.B, self.S, d.block_size, d.num_layers, d.draft_vocab,
        self.opts.theta > 0, self.buckets)))

  def _measure(self, state) -> dict:
    """Seconds per step at this batch shape: AR, and each speculative mode at
    the shortest and longest verify length (the rest interpolated linearly in
    k). Cached in memory and, where possible, on disk."""
    key, table = self._cost_key(), _read_costs(self.cost_path)
    if key in table:
      return table[key]
    start = time.time()
    ends = sorted({self.buckets[0], self.buckets[-1]})
    plan = [("ar", 0)] + [(m, k) for m in ("sequential", "parallel") for k in ends]
    where = self.cost_path or "memory only"
    print(f"flex: timing {len(plan)} step variants at batch {self.B} once (kept in "
          f"{where})", file=sys.stderr, flush=True)
    import tqdm
    timed = {}
    for mode, k in tqdm.tqdm(plan, desc="flex step costs", leave=False,
                             disable=len(plan) < 4 or not sys.stderr.isatty()):
      timed[(mode, k)] = self._time(state, mode, k)
    costs = {"ar": timed[("ar", 0)], "measured_k": ends}
    for mode in ("sequential", "parallel"):
      xs = np.array(ends, float)
      ys = np.array([timed[(mode, k)] for k in ends])
      costs[mode] = {str(k): float(np.interp(k, xs, ys)) for k in self.buckets}
    table[key] = costs
    _write_costs(self.cost_path, table)
    self.timing_spans.append((start, time.time()))  # not decoding: left out of its time
    return costs

  def _time(self, state, mode, k, reps: int = 3) -> float:
    probe = jax.tree.map(lambda x: x.copy(), state)

    def step(st):  # every row live, nothing emitted yet: one full step of work
      st = st._replace(done_B=jnp.zeros_like(st.done_B), n_out_B=jnp.zeros_like(st.n_out_B))
      return self._call(st, mode, k, 1)

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
      out["flex_choices"] = self.choices
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


def _read_costs(path) -> dict:
  """The cost table at `path` (memory only for None); a corrupt file counts as
  empty — its costs are measured again."""
  table = _COSTS_IN_MEMORY.setdefault(path, {})
  if path and os.path.exists(path):
    try:
      with open(path) as f:
        on_disk = json.load(f)
      if not isinstance(on_disk, dict):
        raise ValueError("not a JSON object")
      table.update(on_disk)
    except (OSError, ValueError) as e:
      _warn_once(path, f"flex: ignoring unreadable step-cost cache {path} ({e}); "
                 "measuring again")
  return table


def _write_costs(path, table: dict):
  """Keeps `table` in memory and writes it to `path`; a failure to write warns
  once and is otherwise harmless."""
  _COSTS_IN_MEMORY[path] = table
  if not path:
    return
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
      json.dump(table, f, indent=1)
    os.replace(tmp, path)
  except OSError as e:
    _warn_once(path, f"flex: cannot write the step-cost cache {path} ({e}); keeping "
               "the costs in memory")


def _warn_once(key, message: str):
  if (key, message.split(" (")[0]) not in _WARNED:
    _WARNED.add((key, message.split(" (")[0]))
    warnings.warn(message, RuntimeWarning, stacklevel=3)
