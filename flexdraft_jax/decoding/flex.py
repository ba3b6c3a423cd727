"""Flex's choice of (mode, verify length k): the acceptance model and the policy.

Flex decoding (SPEC §2, §7): parallel while the live batch is at or below `B*`,
sequential above it. With `B* = "auto"` the driver chooses a (mode, verify
length k) pair: it predicts tokens/s = τ(k) / cost(mode, k) — cost(mode, k)
the step cost flex_costs.py measures for this target, drafter, hardware and
batch shape and corrects by what the decoding chunks took — with
τ(k) = 1 + Σ_{i<k} Π_{j≤i} r_j, r_j the acceptance rate of draft slot j
given the slots before it were accepted — counted from the recent steps where
slot j was verified (older counts weigh `ACCEPT_DECAY` less per `DECAY_STEPS`
steps of a chunk that verified slot j: a run at a short k keeps what longer
steps saw), blended with a prior from the drafts' own confidences — slot j's
confidence given the slots before it were accepted, the ratio of the mean
Π_{i≤j} conf_i to the mean Π_{i<j} conf_i, scaled by how well they have
predicted acceptance at this temperature (`prior_scale`) — which is all there
is for slots never verified. AR competes with τ = 1;
a speculative choice must beat it by `AR_MARGIN` to start, and stays while
it is predicted at least as fast (AR steps observe no acceptance, so a switch
to AR on a noisy estimate would stand unchallenged until the next probe).
Until a (mode, k) has timed steps at this batch shape its chunks are short
(`PROBE_STEPS`), so a wrong first choice costs a few steps. AR learns nothing
about acceptance, so where speculation came close flex probes it again after
`AR_STRETCH` AR steps, then after twice as many, and so on — later where a
probe that gained nothing would cost more than `PROBE_BUDGET` of that AR
time. A batch ends with its slowest row, so at B > 1 the τ that counts is
what a speculative step gains the row with the most steps left (`row_tau`:
each row's own progress in speculative steps against the rows' beside it, or
its drafts' confidence, and its tokens left).
`stats()` reports, per batch shape, what flex predicted for the chunks it ran
against what they measured, and its predicted × AR of each (mode, k) over
the run.
"""

from __future__ import annotations

import numpy as np

from flexdraft_jax.decoding import flex_costs
from flexdraft_jax.decoding.options import TREE, Mode

# Pseudo-row-steps of the confidence-based prior in each slot's acceptance
# rate: a slot verified n times weighs its own count n / (n + PRIOR_WEIGHT).
PRIOR_WEIGHT = 8
# Pseudo-counts (expected acceptances) of the starting scale in the fit of how
# confidence predicts acceptance (prior_scale): few, since where acceptance is
# low (T > 0) slots past the first are verified rarely.
SCALE_WEIGHT = 4
# The starting scale at temperature T with nothing seen in this process:
# 1 - TEMPERATURE_SCALE * min(T, 1)^2. An argmax draft is accepted with the
# target's p_T(draft): the shipped SmolLM2 drafter's slot 1 accepts 0.78 at
# T = 0, 0.61 at T = 0.7 and 0.35 at T = 1 on GSM8K (on the target's answers
# sampled at T; MT-Bench 0.48, 0.41, 0.25; docs/results/acceptance_match.md):
# ratios 0.77-0.84 and 0.45-0.51. Sampled drafts (`draft_sampling`) are
# accepted with Σ min(p_T, q): 0.65 and 0.45 on GSM8K (MT-Bench 0.44, 0.35),
# ratios 0.84-0.92 and 0.57-0.72 (TEMPERATURE_SCALE_SAMPLED). The run's own
# counts then refit it.
TEMPERATURE_SCALE = 0.55
TEMPERATURE_SCALE_SAMPLED = 0.35
# (target, drafter config, temperature, sampled drafts) -> the last fitted
# prior_scale in this process: where the next request with them starts (its
# first guess).
_SCALES: dict = {}
# A speculative (mode, k) starts only if its predicted tokens/s is at least this
# times AR's: step timings on a shared CPU vary by ~10 %, and AR is the safe side.
# Once speculating it stays while it is predicted at least as fast as AR
# (STAY_MARGIN): it keeps measuring acceptance there, AR would not.
AR_MARGIN = 1.05
STAY_MARGIN = 1.0
# Steps of a speculative chunk while its (mode, k) has no timed steps at this batch
# shape: a wrong first choice costs a few steps, not a whole chunk.
PROBE_STEPS = 4
# Before a chunk's acceptance counts are added, the older ones are scaled by
# ACCEPT_DECAY per DECAY_STEPS steps the chunk ran: τ follows what the rows live
# now do (once some rows are done, the batch waits on the rest, whose
# acceptance may be lower than the batch's was). Per step, not per chunk: with
# selective verification every chunk is one step, and a decay per chunk kept
# two steps' counts (the prior then decided, 1.5x optimistic at batch 1).
ACCEPT_DECAY = 0.5
DECAY_STEPS = 16
# AR does not see acceptance, so a run that fell back to AR would never learn
# that speculation pays again: after AR_STRETCH AR steps (doubling after every
# probe that does not win) flex probes its best speculative (mode, k) for
# PROBE_STEPS steps — only where that is predicted within a factor EXPLORE of
# winning, so where speculation is far behind (large batches on a CPU) AR runs
# untouched.
AR_STRETCH = 16
EXPLORE = 0.8
# A probe waits, beyond AR_STRETCH, until what it would lose if it gained
# nothing (PROBE_STEPS speculative steps in place of as many AR steps) is at
# most this share of the AR time since the last probe. Not the predicted loss:
# before anything is verified the prediction rests on the drafts' confidence,
# which runs high (batch 4 here: predicted 0.92x AR, and the probe gained the
# batch's last row nothing; two such probes in 64 steps cost ≈ 5 %).
PROBE_BUDGET = 0.04


def tree_budgets(budget) -> tuple:
  """The draft-tree budgets flex weighs under `SpecOptions.tree_budget` N: the
  powers of two from 8 below N, and N (() without a budget)."""
  if not budget:
    return ()
  out, b = [], 8
  while b < budget:
    out.append(b)
    b *= 2
  return tuple(out) + (budget,)


class FlexPolicy:
  """What flex has seen (per-slot acceptance, step costs) and what it chooses.

  The step costs, and the kinds of step weighed (`families`), are its
  `cost_model`'s (flex_costs.StepCosts, given `time_step`).
  """

  def __init__(self, target, drafter, opts, buckets, time_step, parallel_drafter=None,
               tree_mass=None, temperature: float = 0.0, sampled_drafts: bool = False):
    self.opts = opts
    # Where confidence's scale starts (prior_scale): what the last request with
    # this target, drafter and temperature ended with in this process.
    self._scale_key = (getattr(target, "fingerprint", None), repr(drafter.config),
                       round(float(temperature), 3), bool(sampled_drafts))
    c = TEMPERATURE_SCALE_SAMPLED if sampled_drafts else TEMPERATURE_SCALE
    self.scale0 = _SCALES.get(self._scale_key, 1.0 - c * min(float(temperature), 1.0) ** 2)
    # Draft trees (`tree_budget`): sequential steps verifying a tree of N nodes
    # compete as (TREE, N); `tree_mass(state, N)` gives their nodes' draft
    # probabilities (the prior of their τ, `tau_by_tree`).
    self.tree_mass = tree_mass
    budgets = tree_budgets(getattr(opts, "tree_budget", None)) if tree_mass else ()
    self.cost_model = flex_costs.StepCosts(target, drafter, opts, buckets, time_step,
                                           parallel_drafter, budgets)
    # Per budget, decayed over its chunks: [row-steps, tokens] of tree steps.
    self.tree_seen = {n: np.zeros(2) for n in budgets}
    bs = drafter.config.block_size
    self.ar_hist = 0               # the accept histogram's counts from AR steps
    # Draft slot i (1-based): row-steps where it was verified / accepted.
    self.verified = np.zeros(bs)
    self.accepted = np.zeros(bs)
    # ... and how many of them the confidence prior expected, at the prior
    # each was chosen on (`_prior_c`, slot i's conditional confidence): the
    # fit of the prior's scale (tau_by_length).
    self.expected = np.zeros(bs)
    self._prior_c = np.ones(bs)
    self.choices = {}              # batch rows -> the last choice and its prediction
    # Mean confidence survival per slot over recent choices (decayed), whence
    # the prior of slots with few verifications (tau_by_length).
    self.conf_sum, self.conf_n = np.zeros(bs), 0.0
    self.ar_stretch = AR_STRETCH   # AR steps before the next probe, at least
    self.probe_at = AR_STRETCH     # ... and with PROBE_BUDGET (see choose)
    self.ar_since_probe = 0
    self.probing = False           # the running chunk is a probe
    self.explore_ar = False        # AR was chosen with speculation close behind
    # Per-row progress: a batch finishes with its slowest row, so a speculative
    # step is worth what it gains the row that will finish last (see row_tau).
    self.max_new = None            # each row's token budget (set by the driver)
    # Per row, decayed over speculative chunks: its tokens, its steps, and the
    # tokens the rows live beside it made per row over the same steps (row_tau).
    self.row_tok = self.row_steps = self.row_mean = None
    self._prev_n_out = None
    self._last_chunk = (Mode.AR, 0)
    self.timing_ar = False         # the next AR chunk times AR (see choose)
    # Batch rows -> {(mode, k) name: [Σ steps · predicted × AR, Σ steps]}: each
    # prediction weighed by the steps decoded on it (stats: "run_predicted_over_ar").
    self.predicted_run = {}
    self._predicted = {}
    self._chosen = None            # ((mode, k), its predicted tokens/s)

  def observe(self, delta_hist, mode: str, k: int, B: int = 0, steps: int = 0,
              seconds: float = 0.0, compiled: bool = False):
    """A chunk at (mode, k) on B rows: its accepted-length histogram (index
    a + 1), and the `steps` it ran in `seconds` of wall time; a chunk during
    which JAX compiled something (`compiled`) says nothing about step costs."""
    self._last_chunk = (mode, steps)
    if mode == Mode.AR:  # τ comes from speculative steps only
      self.ar_hist = self.ar_hist + delta_hist
      self.ar_since_probe += steps
    elif mode == TREE:  # a tree's τ is its own (tau_by_tree)
      seen = self.tree_seen[k]
      seen *= self._decay(steps)
      seen += (delta_hist.sum(), (np.arange(len(delta_hist)) * delta_hist).sum())
    else:
      # Older chunks weigh less in the slots this one verified (ACCEPT_DECAY per
      # DECAY_STEPS steps); the slots beyond its k keep what longer steps
      # measured there.
      decay = self._decay(steps)
      for counts in (self.verified, self.accepted, self.expected):
        counts[1:k] *= decay
      self.count_acceptance(delta_hist, k)
      _SCALES[self._scale_key] = self.prior_scale()
    if steps <= 0:
      return
    for name, ratio in self._predicted.items():
      acc = self.predicted_run.setdefault(B, {}).setdefault(name, [0.0, 0])
      acc[0] += steps * ratio
      acc[1] += steps
    if compiled:
      return
    on_choice = self._chosen and self._chosen[0] == (mode, k)
    tokens = int((np.arange(len(delta_hist)) * delta_hist).sum())
    self.cost_model.observe(B, mode, k, steps, seconds, tokens,
                            predicted=self._chosen[1] if on_choice else None)

  @staticmethod
  def _decay(steps: int) -> float:
    """What older acceptance counts weigh after a chunk of `steps` steps (a
    chunk that only refreshed drafts counts as one)."""
    return ACCEPT_DECAY ** (max(steps, 1) / DECAY_STEPS)

  def chunk_steps(self, B: int, mode: str, k: int, default: int) -> int:
    """Steps of the next chunk at (mode, k): short for a probe or until its
    costs are timed; AR until the next probe is due."""
    if self.opts.flex_threshold != "auto":
      return default
    if mode == Mode.AR:
      if not self.explore_ar:
        return default
      return max(1, min(default, self.probe_at - self.ar_since_probe))
    # The mode's timed steps at any k: its costs at other k are interpolated
    # and share its correction (cost_scale), so a new k needs no probe.
    timed = self.cost_model.timed_steps(B, mode)
    if self.probing or timed < flex_costs.MIN_TIMED:
      return min(default, PROBE_STEPS)
    return default

  def count_acceptance(self, delta_hist, k: int):
    """Adds a chunk's verified and accepted counts per slot, and what the
    confidence prior the chunk was chosen on (`_prior_c`) expected of them."""
    a = np.arange(len(delta_hist)) - 1
    for i in range(1, k):
      verified = delta_hist[a >= i - 1].sum()
      self.verified[i] += verified
      self.accepted[i] += delta_hist[a >= i].sum()
      self.expected[i] += verified * self._prior_c[i]

  def sticky_ar(self, last_mode) -> bool:
    """An AR choice stands until the batch shape changes or, where
    speculation came close (`explore_ar`), until the next probe is due: AR
    steps observe no τ, so the prediction cannot change meanwhile."""
    return (self.opts.flex_threshold == "auto" and self.cost_model.costs is not None
            and last_mode == Mode.AR
            and not (self.explore_ar and self.ar_since_probe >= self.probe_at))

  def shape_changed(self):
    self.cost_model.shape_changed()  # step costs depend on the batch
    self.row_tok = self.row_steps = self.row_mean = self._prev_n_out = None  # the rows moved

  def _see_rows(self, state):
    """Adds each row's tokens over the last chunk, if it was speculative, and
    the mean tokens per row of the rows live through it (row_tau's yardstick;
    rows that finished in it included: their steps are in τ's counts)."""
    n_out = np.asarray(state.n_out_B)
    if self.row_tok is None or len(self.row_tok) != len(n_out):
      self.row_tok, self.row_steps = np.zeros(len(n_out)), np.zeros(len(n_out))
      self.row_mean = np.zeros(len(n_out))
      self._prev_n_out = None
    mode, steps = self._last_chunk
    if self._prev_n_out is not None and mode != Mode.AR and steps > 0:
      ran = self._prev_live  # the rows live when the chunk began
      made = (n_out - self._prev_n_out)[ran]
      if ran.any():
        for a in (self.row_tok, self.row_steps, self.row_mean):
          a *= self._decay(steps)
        self.row_tok[ran] += made
        self.row_steps[ran] += steps
        self.row_mean[ran] += made.mean()
    self._prev_n_out, self._prev_live = n_out.copy(), ~np.asarray(state.done_B)

  def row_tau(self, state, tau_k: float) -> float:
    """The τ that speeds up the batch's finish: each live row's τ is τ(k)
    scaled by how it accepts relative to the rows its acceptance counts came
    from, g_i = (p_i - 1) / (p̄_i - 1) — p_i its tokens per speculative step
    and p̄_i the mean of the rows live through the same steps (finished rows
    included: they are in τ(k)'s counts), where it has PROBE_STEPS of them;
    else its drafts' confidence against the live rows' — and the batch ends
    when the row with the most steps left does: max_i R_i / max_i (R_i / τ_i),
    R_i its tokens left. A row left alone goes at its own pace, not the
    batch's."""
    live = ~np.asarray(state.done_B)
    if not live.any() or tau_k <= 1.0:
      return tau_k
    conf = np.asarray(state.conf_BxD, np.float64)[live]
    tc = 1.0 + np.cumprod(conf, axis=1).sum(1)
    g = (tc - 1.0) / max(tc.mean() - 1.0, 1e-9)
    if self.row_tok is not None and len(self.row_tok) == len(live):
      steps, tok, mean = self.row_steps[live], self.row_tok[live], self.row_mean[live]
      gain = mean - steps  # the tokens beyond one a step of the rows beside it
      have = (steps >= PROBE_STEPS) & (gain > 1e-6)  # (none gained: no yardstick)
      g[have] = (tok[have] - steps[have]) / gain[have]
    tau_i = 1.0 + (tau_k - 1.0) * np.clip(g, 0.0, 3.0)
    n_out = np.asarray(state.n_out_B)[live]
    left = (np.maximum(self.max_new - n_out, 1) if self.max_new
            else np.ones(len(n_out)))
    return float(left.max() / (left / tau_i).max())

  def choose(self, state, live: int, k: int, B: int, S: int) -> tuple:
    """(mode, k) for the next chunk at batch B (`live` rows live); `k` is the
    verify length the options ask for."""
    if self.opts.flex_threshold != "auto":
      small = live <= self.opts.flex_threshold and Mode.PARALLEL in self.cost_model.modes
      return (Mode.PARALLEL if small else Mode.SEQUENTIAL), k
    cm = self.cost_model
    cm.time_if_needed(state, B, S)
    self._see_confidence(state)
    self._see_rows(state)
    self._prior_c = self._conf_ratio()  # what the next chunk's counts are held to
    rates = self.predicted_rates(state, B)
    best = max((c for c in rates if c[0] != Mode.AR), key=rates.get)
    ar_rate, best_rate = rates[(Mode.AR, 0)], rates[best]
    self.probing = False
    speculating = self._last_chunk[0] != Mode.AR
    margin = STAY_MARGIN if speculating else AR_MARGIN
    # AR's own chunks at B, or the machine's slowdown borrowed from the others:
    ar_borrows = cm.borrows(B, Mode.AR)
    own_ar_rate = 1.0 / cm.costs["ar"] if ar_borrows else ar_rate
    self.timing_ar = (ar_borrows and best_rate >= margin * ar_rate
                      and best_rate < margin * own_ar_rate)
    if self.timing_ar:
      # Speculation wins only if AR slowed down as much as it did; that may be
      # its own timing that was off (k = 8 timed 20 % low at batch 2 here, while
      # AR ran as timed): MIN_TIMED AR steps tell.
      best, self.explore_ar = (Mode.AR, 0), True
      self.ar_since_probe, self.probe_at = 0, flex_costs.MIN_TIMED
    elif best_rate < margin * ar_rate:
      # Not worth it by the estimate; probe it now and then if it came close.
      self.explore_ar = best_rate >= EXPLORE * AR_MARGIN * ar_rate
      self.probe_at = self._probe_at(B, best)
      if self.explore_ar and self.ar_since_probe >= self.probe_at:
        self.probing, self.ar_since_probe = True, 0
        self.ar_stretch *= 2
      else:
        best = (Mode.AR, 0)
    else:
      self.ar_stretch, self.ar_since_probe = AR_STRETCH, 0
    name = lambda m, kk: f"{m}:{kk}" if kk else m
    self._predicted = {name(m, kk): r / ar_rate for (m, kk), r in rates.items()
                       if m != Mode.AR}
    self._chosen = (best, rates[best] * live)
    self.choices[str(B)] = {
        "choice": [str(best[0]), best[1]],
        "tokens_per_s": {name(m, kk): round(r * live, 2) for (m, kk), r in rates.items()},
        "measured_tokens_per_s": cm.measured_rates(B, name),
        "cost_scale": cm.scales(B, name),
        "probe": self.probing,
        "timing_ar": self.timing_ar,
        "next_probe_after_ar_steps": (self.probe_at - self.ar_since_probe
                                      if self.explore_ar and best[0] == Mode.AR else None)}
    return best

  def _probe_at(self, B: int, best) -> int:
    """AR steps since the last probe before probing `best` again: `ar_stretch`,
    or more where PROBE_STEPS steps of `best` that gain nothing over AR would
    cost more than PROBE_BUDGET of them."""
    ratio = self.cost_model.seconds(B, *best) / self.cost_model.seconds(B, Mode.AR)
    loss = PROBE_STEPS * max(ratio - 1.0, 0.0)  # AR steps
    return max(self.ar_stretch, int(np.ceil(loss / PROBE_BUDGET)))

  def _see_confidence(self, state):
    """Adds the live rows' mean survival of the drafts' confidence, P(slots
    1..i all accepted) ≈ Π_{j≤i} conf_j per row, to the decayed mean."""
    conf = np.asarray(state.conf_BxD, np.float64)
    live = ~np.asarray(state.done_B)
    surv = np.cumprod(conf[live] if live.any() else conf, axis=1).mean(0)
    self.conf_sum = ACCEPT_DECAY * self.conf_sum + np.concatenate([[1.0], surv])
    self.conf_n = ACCEPT_DECAY * self.conf_n + 1.0

  def predicted_rates(self, state, B: int = 0) -> dict:
    """{(mode, k): predicted tokens per second per row} for AR and every bucket:
    τ(k) over the step cost, corrected by what the chunks at B rows took."""
    cm = self.cost_model
    tau = self.tau_by_length(state)
    taus = {m: tau for m in cm.modes}
    if cm.tree_budgets:
      taus[TREE] = self.tau_by_tree(state, tau[cm.buckets[-1]])
    rates = {(Mode.AR, 0): 1.0 / cm.seconds(B, Mode.AR)}
    for mode, ks in cm.families:
      for k in ks:
        rates[(mode, k)] = self.row_tau(state, taus[mode][k]) / cm.seconds(B, mode, k)
    return rates

  def tau_by_tree(self, state, tau_chain: float) -> dict:
    """{N: predicted τ of a draft tree of N nodes}: its own tree steps' tokens
    per row-step, plus PRIOR_WEIGHT pseudo-steps of a prior — the chain's τ(k)
    scaled by how much more draft probability the tree's paths hold than the
    chain's (Σ of the nodes' path probabilities against Σ_i Π_{j≤i} conf_j),
    corrected by how the budgets that ran measured against that prior."""
    budgets = self.cost_model.tree_budgets
    live = ~np.asarray(state.done_B)
    mass = self.tree_mass(state, budgets[-1])
    mass = mass[live] if live.any() else mass
    chain = np.cumprod(np.asarray(state.conf_BxD, np.float64), axis=1)
    chain = (chain[live] if live.any() else chain).sum(1).mean()
    gain = np.cumsum(mass.mean(0))               # budget n: gain[n - 2]
    prior = {n: 1.0 + (tau_chain - 1.0) * gain[n - 2] / max(chain, 1e-9)
             for n in budgets}
    steps = sum(self.tree_seen[n][0] for n in budgets)
    fit = 1.0
    if steps >= PRIOR_WEIGHT:  # measured gain over the prior's, where trees ran
      got = sum(self.tree_seen[n][1] - self.tree_seen[n][0] for n in budgets)
      want = sum(self.tree_seen[n][0] * (prior[n] - 1.0) for n in budgets)
      fit = float(np.clip(got / max(want, 1e-9), 0.25, 4.0))
    out = {}
    for n in budgets:
      rows, tokens = self.tree_seen[n]
      p = 1.0 + fit * (prior[n] - 1.0)
      out[n] = float((tokens + PRIOR_WEIGHT * p) / (rows + PRIOR_WEIGHT))
    return out

  def _conf_ratio(self) -> np.ndarray:
    """Slot i's acceptance rate by the drafts' confidence, given slots < i were
    accepted: the ratio of the mean survivals Π_{j≤i} conf_j over choices (a
    draft after confident ones is itself more often confident, so the mean
    confidence per slot runs low here); index 0 is 1."""
    surv = self.conf_sum / self.conf_n
    return surv / np.maximum(np.concatenate([[1.0], surv[:-1]]), 1e-9)

  def prior_scale(self) -> float:
    """How the drafts' confidence predicts acceptance here: the slots'
    accepted counts over what the prior they were chosen on expected, plus
    SCALE_WEIGHT pseudo-counts of the scale this drafter and temperature ended
    with in this process before (the first time: 1 at T = 0, lower at T > 0,
    see TEMPERATURE_SCALE). Fitted on slots 2.. once
    they have PRIOR_WEIGHT verifications — the prior matters most for them,
    and slot 1, verified most, runs more overconfident than the rest (the
    shipped SmolLM2 drafter: 0.72 vs 0.55 accepted; slots 2-5 within ±0.05 given
    the slots before them were accepted, 661 steps) — else on every slot. At
    T > 0 an argmax draft is accepted with the target's p_T(draft), well under
    its confidence at T = 1 (the scale reads ≈ 0.5 there), which the fit learns."""
    first = 2 if self.verified[2:].sum() >= PRIOR_WEIGHT else 1
    got, want = self.accepted[first:].sum(), self.expected[first:].sum()
    scale = (got + SCALE_WEIGHT * self.scale0) / (want + SCALE_WEIGHT)
    return float(np.clip(scale, 0.25, 4.0))

  def tau_by_length(self, state) -> dict:
    """{k: predicted τ(k)} from the per-slot acceptance rates (module doc):
    each slot's verified counts, plus PRIOR_WEIGHT pseudo-steps of its draft
    confidence given the slots before it were accepted, scaled by how well
    confidence has predicted acceptance (`prior_scale`; the only estimate for
    slots never verified)."""
    if self.conf_n == 0:
      self._see_confidence(state)
    prior = np.clip(self.prior_scale() * self._conf_ratio(), 0.0, 1.0)
    r = (self.accepted + PRIOR_WEIGHT * prior) / (self.verified + PRIOR_WEIGHT)
    survive = np.cumprod(r[1:])  # P(slots 1..i all accepted)
    return {k: 1.0 + float(survive[:k - 1].sum()) for k in self.cost_model.buckets}

  def stats(self) -> dict:
    """The measured step costs, and per batch shape: the last choice with its
    predictions; each speculative (mode, k)'s predicted × AR over the run (the
    mean of the predictions the steps ran on); and per (mode, k) flex ran, its
    steps with the tokens/s predicted for them and measured while they ran."""
    choices = {b: dict(c) for b, c in self.choices.items()}
    for b, acc in self.predicted_run.items():
      if str(b) in choices:
        choices[str(b)]["run_predicted_over_ar"] = {
            n: round(t / w, 3) for n, (t, w) in acc.items() if w}
    for b, chunks in self.cost_model.chunk_records().items():
      if str(b) in choices:
        choices[str(b)]["chunks"] = chunks
    return {"flex_threshold": self.opts.flex_threshold, "step_costs": self.cost_model.measured,
            "flex_choices": choices}
