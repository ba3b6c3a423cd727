"""T > 0: each mode samples the target's distribution (χ² against the exact one)."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import flexdraft_jax as fd
from flexdraft_jax.decoding.sampling import processed_logits
from tests.decoding_util import bigram_drafter, tiny_target, vocab_drafter

V, N, PROMPT, TEMP = 8, 6000, [3, 5], 1.0


def _setup():
  target = tiny_target(vocab=V, eos=0, scale=0.5, seed=4)
  drafter = bigram_drafter(target)
  return target, drafter, _exact_distribution(target)


@pytest.fixture(scope="module")
def setup():
  return _setup()


def _exact_distribution(target):
  """P(t0, t1, t2 | PROMPT) under temperature TEMP, as a [V, V, V] array."""
  pairs = np.array(list(itertools.product(range(V), repeat=2)))
  ids = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], axis=1)
  lg = fd.target_logits(target, ids)
  from flexdraft_jax.decoding.sampling import SamplingParams
  p = np.asarray(jax.nn.softmax(processed_logits(lg, SamplingParams(TEMP)), axis=-1),
                 np.float64)
  p0 = p[0, 1]                                   # after the prompt
  p1 = p[np.arange(0, len(pairs), V), 2]         # after t0 (row t0*V)
  p2 = p[:, 3].reshape(V, V, V)                  # after t0, t1
  return p0[:, None, None] * p1[:, :, None] * p2


def _chi2_pvalue(tokens, exact):
  counts = np.zeros((V, V, V))
  for t in tokens:
    counts[tuple(t[:3])] += 1
  expected = exact.ravel() * len(tokens)
  big = expected >= 5
  obs = np.append(counts.ravel()[big], counts.ravel()[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] < 5:  # fold a tiny remainder into the smallest kept cell
    obs, exp = obs[:-1], exp[:-1]
    obs[np.argmin(exp)] += counts.ravel()[~big].sum()
    exp[np.argmin(exp)] += expected[~big].sum()
  return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def _kept(r):
  """Tokens the acceptance rule kept per row verification, drafts past the third
  token included: with 3 new tokens, emitted τ barely leaves 1 even when the rule
  accepts, so this is what shows the rule was exercised."""
  return r.stats["committed_tokens"] / r.stats["verified_row_steps"]


def _sample(target, drafter, mode, draft_sampling=False, **spec):
  r = fd.generate(target, [PROMPT] * N, max_new_tokens=3,
                  sampling=fd.SamplingParams(temperature=TEMP, draft_sampling=draft_sampling),
                  drafter=drafter, mode=mode, stop=[], seed=11,
                  speculation=fd.SpecOptions(**spec))
  assert all(len(t) == 3 for t in r.token_ids)
  return r


@pytest.mark.parametrize("mode, kw", [
    ("ar", {}),
    ("parallel", {}),
    ("parallel", {"threshold": 0.2}),
    ("sequential", {}),
    ("parallel", {"draft_sampling": True}),
])
def test_each_mode_samples_the_target_distribution(setup, mode, kw):
  target, drafter, exact = setup
  r = _sample(target, drafter, mode, **kw)
  if mode != "ar":  # drafts were accepted, so the acceptance rule was exercised
    assert _kept(r) > 1.08, _kept(r)
  assert _chi2_pvalue(r.token_ids, exact) > 1e-3


@pytest.mark.parametrize("mode, kw", [
    ("sequential", {}),
    ("parallel", {"draft_sampling": True}),
])
def test_a_draft_vocabulary_samples_the_target_distribution(setup, mode, kw):
  # Two tokens can never be drafted; sampled drafts' q is zero there.
  target, drafter, exact = setup
  small = vocab_drafter(drafter, [5, 2, 7, 0, 3, 6])
  r = _sample(target, small, mode, **kw)
  assert _kept(r) > 1.05, _kept(r)
  assert _chi2_pvalue(r.token_ids, exact) > 1e-3


def test_a_short_verify_length_samples_the_target_distribution():
  target = tiny_target(vocab=V, eos=0, scale=0.5, seed=4)
  drafter = bigram_drafter(target, block_size=4)
  r = _sample(target, drafter, "sequential", verify_len=2)
  assert _kept(r) > 1.08, _kept(r)
  assert max(k for k, _ in r.stats["group_counts"]) == 2
  assert _chi2_pvalue(r.token_ids, _exact_distribution(target)) > 1e-3


def _lossy_rule(target_params, cfg, h, state, vlen_B, sp):
  """A wrong acceptance rule: keep a draft whenever the target gives it ≥ 10 %."""
  from flexdraft_jax.decoding.sampling import sample
  from flexdraft_jax.model import transformer
  lg = transformer.logits(target_params, cfg, h)
  y = sample(lg, jax.random.fold_in(state.key, state.steps), sp)
  p = jax.nn.softmax(processed_logits(lg, sp), -1)
  D = state.drafts_BxD.shape[1]
  p_d = jnp.take_along_axis(p[:, :D], state.drafts_BxD[..., None], -1)[..., 0]
  ok = (p_d >= 0.1) & (jnp.arange(D)[None] < vlen_B[:, None])
  return y, jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)


_LOSSY_DRIVER = """
from flexdraft_jax.decoding import verify
from tests import test_sampling_lossless as t
target, drafter, exact = t._setup()
verify.verify_block = t._lossy_rule
r = t._sample(target, drafter, "parallel")
print("pvalue", t._chi2_pvalue(r.token_ids, exact))
"""


def _pvalue_in_subprocess(driver: str) -> float:
  """The χ² p-value a driver script prints, run in its own process: steps
  compiled here with the right rule must not be reused, and this process's
  compiled steps must not see the wrong one."""
  import subprocess
  import sys
  from tests import tiny
  env = dict(os.environ, FLEXDRAFT_TEST_XLA_CACHE=jax.config.jax_compilation_cache_dir)
  out = subprocess.run([sys.executable, "-c", driver], cwd=tiny.REPO, env=env,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-2000:]
  return float(out.stdout.split("pvalue")[-1])


def test_a_wrong_acceptance_rule_fails():
  assert _pvalue_in_subprocess(_LOSSY_DRIVER) < 1e-6


@pytest.mark.parametrize("kw", [{}, {"draft_sampling": True}])
def test_a_drafter_reading_the_bonus_samples_the_target_distribution(setup, kw):
  # bonus_input: drafts come from a deep-only pass after the bonus is sampled.
  import dataclasses
  target, drafter, exact = setup
  H = target.config.hidden_size
  w = 2.0 * jax.random.normal(jax.random.PRNGKey(3), (H, H)) / np.sqrt(H)
  reading = drafter._replace(config=dataclasses.replace(drafter.config, bonus_input=True),
                             params=dict(drafter.params, bonus_in=w))
  r = _sample(target, reading, "sequential", **kw)
  assert _kept(r) > 1.08, _kept(r)
  assert _chi2_pvalue(r.token_ids, exact) > 1e-3


@pytest.mark.parametrize("kw", [{}, {"draft_sampling": True}])
def test_a_drafter_with_the_ngram_prior_samples_the_target_distribution(setup, kw):
  # Slot j's draft distribution is re-scored given the (sampled) drafts before
  # it; rejection sampling uses that q.
  from tests.decoding_util import ngram_drafter
  target, _, exact = setup
  r = _sample(target, ngram_drafter(target, block_size=4, weight=1.0), "sequential", **kw)
  assert _kept(r) > 1.08, _kept(r)
  assert _chi2_pvalue(r.token_ids, exact) > 1e-3


@pytest.mark.parametrize("mode, prior", [("sequential", True), ("parallel", False)])
def test_a_fitted_draft_temperature_samples_the_target_distribution(setup, mode, prior):
  # Slot j's drafts sampled at T·r_j (DrafterConfig.draft_temperature, between
  # the two listed temperatures here): verification reads the same q.
  import dataclasses
  from tests.decoding_util import ngram_drafter
  target, _, exact = setup
  drafter = (ngram_drafter(target, block_size=4, weight=1.0) if prior
             else bigram_drafter(target, block_size=4))
  fitted = drafter._replace(config=dataclasses.replace(
      drafter.config, draft_temperature=((0.5, (0.5, 2.0, 1.0)), (2.0, (0.5, 4.0, 2.0)))))
  r = _sample(target, fitted, mode, draft_sampling=True)
  assert _kept(r) > 1.05, _kept(r)
  assert _chi2_pvalue(r.token_ids, exact) > 1e-3


@pytest.mark.parametrize("block_size, budget", [(2, 4), (4, 10)])
def test_a_draft_tree_samples_the_target_distribution(block_size, budget):
  # Siblings are point-mass drafts: a node continues where the target's sample
  # at its parent is its token, so a step accepts Σ p(children) at each level.
  target = tiny_target(vocab=V, eos=0, scale=0.5, seed=4)
  drafter = bigram_drafter(target, block_size=block_size, scale=3.0)
  chain = _sample(target, drafter, "sequential")
  r = _sample(target, drafter, "sequential", tree_budget=budget)
  assert _kept(r) > _kept(chain) + 0.05, (_kept(r), _kept(chain))
  assert _chi2_pvalue(r.token_ids, _exact_distribution(target)) > 1e-3


_LOSSY_TREE_DRIVER = """
from flexdraft_jax.decoding import tree
from tests import test_sampling_lossless as t
from tests.decoding_util import bigram_drafter, tiny_target
real = tree.accepted_path
# A wrong rule: the root's first child is taken as if the target had sampled it.
tree.accepted_path = lambda tk, p, d, y, m: real(tk, p, d, y.at[:, 0].set(tk[:, 1]), m)
target = tiny_target(vocab=t.V, eos=0, scale=0.5, seed=4)
r = t._sample(target, bigram_drafter(target, block_size=2, scale=3.0), "sequential",
              tree_budget=4)
print("pvalue", t._chi2_pvalue(r.token_ids, t._exact_distribution(target)))
"""


def test_a_wrong_tree_acceptance_rule_fails():
  assert _pvalue_in_subprocess(_LOSSY_TREE_DRIVER) < 1e-6


def test_drafts_are_sampled_at_t_above_0_unless_asked_otherwise_or_trees(setup):
  # draft_sampling None (auto): sampled drafts at T > 0, argmax drafts with
  # draft trees; the call's stats say which ran.
  target, drafter, _ = setup
  tree_drafter = bigram_drafter(target, block_size=4, scale=3.0)

  def run(ds, d=drafter, temperature=TEMP, **spec):
    r = fd.generate(target, [PROMPT] * 64, max_new_tokens=6, drafter=d, mode="sequential",
                    stop=[], seed=11, speculation=fd.SpecOptions(**spec),
                    sampling=fd.SamplingParams(temperature=temperature, draft_sampling=ds))
    return r.token_ids, r.stats["draft_sampling"]

  assert fd.SamplingParams().draft_sampling is None
  auto, on, off = run(None), run(True), run(False)
  assert auto == on and auto[1] is True and off[1] is False
  assert auto[0] != off[0]  # other drafts, other uniforms read: other samples
  tree_auto, tree_off = run(None, tree_drafter, tree_budget=4), run(False, tree_drafter,
                                                                   tree_budget=4)
  assert tree_auto == tree_off and tree_auto[1] is False
  with pytest.raises(fd.FlexDraftError, match="turn sampling.draft_sampling off"):
    run(True, tree_drafter, tree_budget=4)
  assert run(None, temperature=0.0)[1] is None  # greedy: nothing is sampled


@pytest.mark.parametrize("draft_sampling", [None, False])
def test_flex_switching_modes_every_step_samples_the_target_distribution(
    setup, monkeypatch, draft_sampling):
  # Flex hands the drafts in flight (sampled ones with their q) from one mode
  # to the next: forced here to switch every step (sequential, parallel, AR).
  from flexdraft_jax.decoding import flex
  from flexdraft_jax.decoding.options import Mode
  target, drafter, exact = setup
  cycle, chosen = [Mode.SEQUENTIAL, Mode.PARALLEL, Mode.AR], []

  def choose(self, state, live, k, B, S):
    chosen.append(cycle[len(chosen) % len(cycle)])
    return chosen[-1], (0 if chosen[-1] == Mode.AR else k)

  monkeypatch.setattr(flex.FlexPolicy, "choose", choose)
  r = fd.generate(target, [PROMPT] * N, max_new_tokens=4, drafter=drafter, mode="flex",
                  stop=[], seed=11, runtime=fd.RuntimeOptions(steps_per_call=1),
                  sampling=fd.SamplingParams(temperature=TEMP, draft_sampling=draft_sampling),
                  speculation=fd.SpecOptions(flex_threshold=0))
  assert r.stats["draft_sampling"] is (draft_sampling is None)
  assert {m for m, _ in r.stats["mode_steps"]} == {"sequential", "parallel", "ar"}
  assert _kept(r) > 1.05, _kept(r)
  assert _chi2_pvalue(r.token_ids, exact) > 1e-3


def test_auto_draft_sampling_resolves_to_the_params_greedy_decoding_always_had():
  from flexdraft_jax.decoding.sampling import SamplingParams
  assert SamplingParams().resolved(trees=False) == SamplingParams(draft_sampling=False)
  assert SamplingParams(1.0).resolved(trees=False).draft_sampling is True
  assert SamplingParams(1.0).resolved(trees=True).draft_sampling is False
  assert SamplingParams(1.0, draft_sampling=False).resolved(trees=False).draft_sampling is False
