"""The host loop of every mode: runs jitted chunks until every row is done,
moves live rows to a smaller batch as rows finish, and collects the outputs.
In flex mode it asks `flex.FlexPolicy` for the next (mode, verify length)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax import run_control
from flexdraft_jax.decoding import chunk, flex, timing
from flexdraft_jax.decoding.options import TREE, Mode
from flexdraft_jax.util import round_up

# Once at most half the rows of a batch of at least COMPACT_MIN are live, the
# live rows move to a smaller batch (a power of two, at least COMPACT_FLOOR),
# so finished rows stop costing compute.
COMPACT_MIN, COMPACT_FLOOR = 8, 4
AR_CHUNK = 32  # AR steps per device loop when the batch can still shrink


class Driver:
  """Runs chunks of jitted steps until every row is done."""

  def __init__(self, target, drafter, mode, opts, static, traced, B, S,
               steps_per_call=16, mesh=None, parallel_drafter=None):
    self.target, self.drafter, self.mode, self.opts = target, drafter, mode, opts
    # Parallel steps' own drafter, if any (generate's `parallel_drafter`).
    self.parallel_drafter = parallel_drafter
    self.static, self.traced, self.B, self.S = static, traced, B, S
    self.steps_per_call = steps_per_call
    self.bs = drafter.config.block_size if drafter is not None else 1
    # Verify lengths k that get a compiled step (parallel: k groups).
    self.k_max, self.buckets = (chunk.verify_buckets(self.bs, opts) if drafter
                                else (1, ()))
    self.policy = (flex.FlexPolicy(target, drafter, opts, self.buckets, self._time,
                                   parallel_drafter=parallel_drafter,
                                   tree_mass=self._tree_mass,
                                   temperature=static["sp"].temperature,
                                   sampled_drafts=static["sp"].sampled_drafts)
                   if mode == Mode.FLEX else None)
    self.group_counts, self.modes = [], []
    self.stale_drafts = False
    self.mesh = mesh
    self.row_ids = np.arange(B)   # original row of each state row
    self.outputs = {}             # original row -> tokens, for rows compacted away
    self.emitted = {}             # mode -> [row-steps, tokens emitted] (τ per mode)

  @property
  def timing_spans(self) -> list:
    """(start, end) wall time spent timing steps, not decoding."""
    return self.policy.cost_model.timing_spans if self.policy else []

  def _refreshes(self, mode) -> bool:
    """Whether a chunk of `mode` now first refreshes drafts gone stale in AR."""
    return self.stale_drafts and mode != Mode.AR

  def _chunk(self, state, mode, k, n_steps):
    refresh = self._refreshes(mode)
    self.stale_drafts = (self.stale_drafts or mode == Mode.AR) and not refresh
    return self._call(state, mode, k, n_steps, refresh)

  def _call(self, state, mode, k, n_steps, refresh=False):
    drafter = (self.parallel_drafter if mode == Mode.PARALLEL and self.parallel_drafter
               else self.drafter)
    static = self.static if drafter is None else dict(self.static, dcfg=drafter.config)
    tree_budget = 0
    if mode == TREE:  # sequential steps verifying a draft tree of k nodes
      mode, tree_budget = Mode.SEQUENTIAL, k
    return chunk.run_chunk(
        self.target.params, None if drafter is None else drafter.params, state,
        mode=mode, num_groups=k, n_steps=jnp.int32(n_steps),
        theta=jnp.float32(self.opts.threshold), strategy=self.opts.strategy,
        refresh=refresh, tree_budget=tree_budget, **static, **self.traced)

  def _tree_mass(self, state, budget: int):
    """`[B, budget - 1]`: the draft probability of each node's path in the
    draft tree of `budget` nodes, best first (flex's prior for trees)."""
    return np.asarray(chunk.tree_mass(self.target.params, self.drafter.params, state,
                                      cfg=self.static["cfg"], dcfg=self.drafter.config,
                                      budget=budget))

  def _bucket(self, needed: int) -> int:
    return next((g for g in self.buckets if g >= needed), self.buckets[-1])

  def _needed(self, state):
    g, live = chunk.needed_groups(state, theta=jnp.float32(self.opts.threshold),
                                  strategy=self.opts.strategy)
    return int(g), int(live)

  def run(self, state, max_new: int):
    """Runs to the end; returns the final state (rows in `self.row_ids` order)."""
    for state in self.chunks(state, max_new):
      pass
    return state

  def chunks(self, state, max_new: int, stream: bool = False):
    """Runs to the end, yielding the state after each chunk (the last one is
    the final state). `stream`: AR chunks of at most `steps_per_call` steps, so
    the tokens come out as they are decided (the same tokens either way)."""
    steps = int(state.steps)
    if self.policy:
      self.policy.max_new = max_new
    while True:
      run_control.check()  # a stop whose exception was lost (run_control.py)
      done = np.asarray(state.done_B)
      if done.all():
        return
      state = self._maybe_compact(state, done)
      if self.mode == Mode.AR or (self.policy and self.policy.sticky_ar(
          self.modes[-1][0] if self.modes else None)):
        mode, k = Mode.AR, 0
      else:
        groups, live = self._needed(state)
        mode, k = self._choose(state, live, groups)
      selective = mode != Mode.AR and self.opts.threshold > 0
      if mode == Mode.AR:
        # Plain AR runs exactly as the `ar` mode does: one device loop, or
        # chunks of AR_CHUNK while compaction can still shrink the batch.
        n = AR_CHUNK if self.B >= COMPACT_MIN else max_new
        if stream:
          n = min(n, self.steps_per_call)
      else:  # with θ > 0 the host picks the bucket every step
        n = 1 if selective else self.steps_per_call
      if self.policy:  # flex: probes are short, and so is AR until the next one
        n = self.policy.chunk_steps(self.B, mode, k, n)
      before = np.asarray(state.accept_hist)
      emitted = int(np.asarray(state.n_out_B).sum())
      start, refresh = time.perf_counter(), self._refreshes(mode)
      wall = timing.now()
      state = self._chunk(state, mode, k, n)
      done_steps, steps = int(state.steps) - steps, int(state.steps)  # waits for it
      per_mode = self.emitted.setdefault(mode, [0, 0])
      per_mode[0] += int(np.asarray(state.accept_hist).sum() - before.sum())
      per_mode[1] += int(np.asarray(state.n_out_B).sum()) - emitted
      if self.policy:
        # A chunk that also refreshed stale drafts is not a plain (mode, k) step.
        self.policy.observe(np.asarray(state.accept_hist) - before, mode, k, B=self.B,
                            steps=0 if refresh else done_steps,
                            seconds=time.perf_counter() - start,
                            compiled=bool(timing.compile_spans(wall, timing.now())))
      self._record(mode, k, done_steps)
      yield state

  def _choose(self, state, live: int, groups: int) -> tuple:
    """(mode, k) for the next chunk; `groups` is what selective verification
    asks for (k_max at θ = 0)."""
    k = self._bucket(min(groups, self.k_max)) if self.opts.threshold > 0 else self.k_max
    if self.policy is None:
      if self.mode == Mode.SEQUENTIAL and self.opts.tree_budget:
        return TREE, self.opts.tree_budget
      return self.mode, k
    return self.policy.choose(state, live, k, self.B, self.S)

  def _maybe_compact(self, state, done):
    live = int((~done).sum())
    if self.B < COMPACT_MIN or live > self.B // 2:
      return state
    new_b = max(COMPACT_FLOOR, 1 << (live - 1).bit_length())
    if self.mesh is not None:
      new_b = round_up(new_b, self.mesh.size)
    if new_b >= self.B:
      return state
    order = np.concatenate([np.flatnonzero(~done), np.flatnonzero(done)])
    keep, leave = order[:new_b], order[new_b:]
    out, n_out = np.asarray(state.out_BxO), np.asarray(state.n_out_B)
    for i in leave:
      self.outputs[int(self.row_ids[i])] = out[i, :n_out[i]].tolist()
    self.row_ids = self.row_ids[keep]
    state = chunk.take_rows(state, jnp.asarray(keep, jnp.int32))
    self.B = new_b
    if self.policy:
      self.policy.shape_changed()
    return state

  def rows_so_far(self, state) -> dict:
    """{original row: its tokens so far} of the rows in `state` (the rows
    compacted away were done: their tokens are in `self.outputs`)."""
    out, n_out = np.asarray(state.out_BxO), np.asarray(state.n_out_B)
    return {int(r): out[i, :n_out[i]].tolist() for i, r in enumerate(self.row_ids)}

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

  def _time(self, state, mode, k, reps: int = 1, n: int = 4) -> float:
    """Seconds per step of (mode, k) on a copy of `state`, run as decoding runs
    it: several steps per device loop (one with θ > 0 speculative steps); the
    best of `reps` loops (a shared CPU only ever adds time; flex's `measure`
    calls this round-robin over the variants and keeps the best)."""
    probe = jax.tree.map(lambda x: x.copy(), state)
    if mode not in (Mode.AR, TREE) and self.opts.threshold > 0:
      n = 1

    def run(st, n_steps):  # every row live, nothing emitted yet: full steps of work
      st = st._replace(done_B=jnp.zeros_like(st.done_B), n_out_B=jnp.zeros_like(st.n_out_B))
      return self._call(st, mode, k, n_steps)

    probe = run(probe, 1)  # compile + warm
    best = float("inf")
    for _ in range(reps):
      first, t = int(probe.steps), time.perf_counter()
      probe = run(probe, n)
      ran = int(probe.steps) - first  # waits for the steps
      best = min(best, (time.perf_counter() - t) / max(ran, 1))
    return best

  def stats(self) -> dict:
    out = {"group_counts": self.group_counts,
           "mode_steps": [[str(m), n] for m, n in self.modes],
           "mode_emitted": {str(m): list(v) for m, v in self.emitted.items()}}
    if self.policy:
      out.update(self.policy.stats())
    return out
