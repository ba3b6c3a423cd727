"""offline-accept: expected acceptance Σ min(p_T, q) per slot and temperature."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexdraft_jax import generate
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.training import offline_accept, offline_tau
from tests import decoding_util as du


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("T", [0.7, 1.0])
def test_acceptance_is_one_where_q_is_p_and_zero_off_its_support(T):
  rng = np.random.RandomState(0)
  t = jnp.asarray(rng.randn(5, 12) * 2, jnp.float32)
  sp = SamplingParams(temperature=T)
  point, sampled = offline_accept.expected_accept(t, t, sp)
  np.testing.assert_allclose(sampled, 1.0, atol=1e-5)
  p = _softmax(np.asarray(t) / T)
  np.testing.assert_allclose(point, p.max(-1), rtol=1e-5)   # argmax q = argmax p
  # p under top-k 3; q puts all its mass on the other tokens: nothing accepted.
  sp3 = SamplingParams(temperature=T, top_k=3)
  off = jnp.where(t >= jax.lax.top_k(t, 3)[0][:, -1:], -1e9, t)
  point, sampled = offline_accept.expected_accept(t, off, sp3)
  np.testing.assert_allclose(sampled, 0.0, atol=1e-6)
  np.testing.assert_allclose(point, 0.0, atol=1e-6)
  # A draft vocabulary of 6 ids, q = p renormalised there: Σ min(p, q) = p's mass there.
  vocab = jnp.asarray([0, 2, 3, 7, 9, 11], jnp.int32)
  point, sampled = offline_accept.expected_accept(t, t[:, vocab], sp, vocab)
  np.testing.assert_allclose(sampled, p[:, np.asarray(vocab)].sum(-1), rtol=1e-5)
  best = np.asarray(vocab)[np.asarray(t)[:, np.asarray(vocab)].argmax(-1)]
  np.testing.assert_allclose(point, p[np.arange(5), best], rtol=1e-5)
  # Half of q's mass on p's argmax, half on the least likely token.
  q = np.full((5, 12), -1e9)
  top, low = p.argmax(-1), p.argmin(-1)
  q[np.arange(5), top] = q[np.arange(5), low] = 0.0
  _, sampled = offline_accept.expected_accept(t, jnp.asarray(q, jnp.float32), sp)
  want = np.minimum(p.max(-1), 0.5) + np.minimum(p.min(-1), 0.5)
  np.testing.assert_allclose(sampled, want, rtol=1e-5)


def test_greedy_acceptance_is_the_argmax_match():
  t = jnp.asarray([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]], jnp.float32)
  d = jnp.asarray([[0.0, 5.0, 0.0], [0.0, 5.0, 0.0]], jnp.float32)
  point, sampled = offline_accept.expected_accept(t, d, SamplingParams())
  np.testing.assert_array_equal(point, [1.0, 0.0])
  np.testing.assert_array_equal(sampled, [1.0, 0.0])


def test_a_draft_temperature_ratio_corrects_a_too_sharp_q():
  # q = softmax(2·logits / T) is p at twice the sharpness: the ratio 2 (in the
  # grid) turns it back into p, and the fit picks it over every other ratio.
  rng = np.random.RandomState(1)
  t = jnp.asarray(rng.randn(3, 7, 20), jnp.float32)
  sp = SamplingParams(temperature=1.0)
  grid = np.stack([np.asarray(offline_accept.expected_accept(t, 2 * t, sp, None, r)[1]
                              ).mean(0) for r in offline_accept.RATIO_GRID])
  assert grid.shape == (len(offline_accept.RATIO_GRID), 7)
  assert offline_accept.fitted_ratios({1.0: grid})[1.0] == [2.0] * 7
  assert grid[offline_accept.RATIO_GRID.index(1.0)].max() < 0.97


def test_chain_tau_by_hand():
  # Two anchors, one slot accepted with probability 1/2 each: E τ = 1.5; the
  # walk takes 1 step from the last anchor and 1 + 1/2 from the first.
  tau_sum, steps = offline_accept.chain_tau(np.full((2, 1), 0.5))
  assert tau_sum == pytest.approx(3.0) and steps == pytest.approx(1.5)
  # Every draft accepted: τ = 1 + S at each anchor, ceil(K / (1 + S)) steps.
  tau_sum, steps = offline_accept.chain_tau(np.ones((7, 2)))
  assert tau_sum == pytest.approx(21.0) and steps == pytest.approx(3.0)
  # P(τ = 3) = a1·a2, P(τ = 2) = a1(1 - a2): E τ = 1 + a1 + a1·a2.
  tau_sum, _ = offline_accept.chain_tau(np.array([[0.8, 0.5]]))
  assert tau_sum == pytest.approx(1 + 0.8 + 0.4)


@pytest.fixture(scope="module")
def answered():
  target = du.tiny_target()
  rng = np.random.RandomState(3)
  prompts = [rng.randint(2, 64, size=5).tolist() for _ in range(4)]
  out = generate(target, prompts, max_new_tokens=20, stop=[])
  return target, prompts, [list(map(int, a)) for a in out.token_ids]


def test_greedy_scores_are_offline_taus(answered):
  # At T = 0 the target's argmax at each position is its greedy answer's next
  # token: per-slot acceptance, uniform and walk τ are offline-tau's.
  target, prompts, answers = answered
  drafter = du.bigram_drafter(target, block_size=4)
  o = offline_tau.score(target, drafter, prompts, answers, 32)
  a = offline_accept.score(target, drafter, prompts, answers, 32, temperatures=(0.0, 1.0))
  assert a["anchors"] == o["anchors"] == 80
  assert min(o["acc"]) > 0.03    # a drafter that gets drafts in every slot right
  for kind in ("point", "sampled"):
    np.testing.assert_allclose(a[kind][0]["acc"], o["acc"][:3], atol=1e-6)
    assert a[kind][0]["uniform_tau"] == pytest.approx(o["uniform_tau"])
    assert a[kind][0]["walk_tau"] == pytest.approx(o["walk_tau"])
  for kind in ("point", "sampled"):   # T = 1: probabilities, not hits
    assert all(0 < x < 1 for x in a[kind][1]["acc"])
    assert 1 < a[kind][1]["uniform_tau"] < 4 and a[kind][1] != a[kind][0]


def test_fit_grid_and_ratios_reach_the_scores(answered):
  target, prompts, answers = answered
  drafter = du.ngram_drafter(target, block_size=4)
  r = offline_accept.score(target, drafter, prompts, answers, 32, temperatures=(0.7,),
                           fit=True)
  g = r["grid"][0.7]
  # the grid at ratio 1 is the plain sampled acceptance
  np.testing.assert_allclose(g[offline_accept.RATIO_GRID.index(1.0)], r["sampled"][0]["acc"],
                             rtol=1e-5)
  ratios = offline_accept.fitted_ratios(r["grid"])
  fitted = offline_accept.score(target, drafter, prompts, answers, 32, temperatures=(0.7,),
                                ratios=ratios)
  np.testing.assert_allclose(fitted["sampled"][0]["acc"], g.max(0), rtol=1e-5)
  assert fitted["point"] == r["point"]      # argmax drafts do not see the ratio
  assert ratios[0.7] != [1.0] * 3 and all(
      a > b for a, b in zip(g.max(0), r["sampled"][0]["acc"]))


def test_decoding_samples_drafts_at_the_fitted_slot_temperatures():
  # draft_tokens' q (and so the drafts and their verification) is
  # softmax(logits / (T·r_j)), r_j interpolated in T; argmax drafts unchanged.
  import dataclasses
  from flexdraft_jax.decoding import state
  from flexdraft_jax.drafter import model as drafter_model
  target = du.tiny_target()
  d = du.random_drafter(target, block_size=4, noise=0.5)
  fitted = d._replace(config=dataclasses.replace(
      d.config, draft_temperature=[[1.0, [0.5, 1.0, 2.0]], [0.5, [1.0, 1.0, 1.0]]]))
  assert fitted.config.draft_temperature == ((1.0, (0.5, 1.0, 2.0)), (0.5, (1.0, 1.0, 1.0)))
  hm = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 32))
  bonus = jnp.asarray([3, 9], jnp.int32)
  lg = np.asarray(drafter_model.draft_logits(target.params, target.config, d, hm[:, 1:],
                                             jnp.broadcast_to(bonus[:, None], (2, 3))))
  key = jax.random.PRNGKey(1)
  for T, r in ((0.75, [0.75, 1.0, 1.5]), (2.0, [0.5, 1.0, 2.0]), (0.3, [1.0, 1.0, 1.0])):
    sp = SamplingParams(temperature=T, draft_sampling=True)
    q = np.asarray(state.draft_tokens(target.params, target.config, fitted, hm, bonus, sp,
                                      key).q_BxDxV)
    np.testing.assert_allclose(q, _softmax(lg / (T * np.asarray(r))[:, None]), atol=1e-5)
  greedy = lambda dr, sp: np.asarray(state.draft_tokens(
      target.params, target.config, dr, hm, bonus, sp, key).ids_BxD)
  for sp in (SamplingParams(), SamplingParams(temperature=1.0, draft_sampling=False)):
    np.testing.assert_array_equal(greedy(fitted, sp), greedy(d, sp))
  with pytest.raises(FlexDraftError, match="draft_temperature entry"):
    dataclasses.replace(d.config, draft_temperature=[[1.0, [1.0, 1.0]]]).validate(
        target.config)


def test_command_fits_and_writes_a_drafter_that_decodes_greedy_as_before(tmp_path, capsys,
                                                                         absl_flags_restored):
  import flexdraft_jax as fd
  from flexdraft_jax.drafter import checkpoint
  from tests import data_fixture
  target = fd.load_target("random:tiny")
  drafter = du.random_drafter(target, block_size=4, noise=0.5)
  src = checkpoint.save_drafter(str(tmp_path / "d"), drafter, target)
  out = str(tmp_path / "fitted")
  argv = ["flexdraft_jax offline-accept", "--model=random:tiny", f"--drafters={src}",
          "--datasets=gsm8k", "--limit=3", "--max_new_tokens=8", "--temperatures=0,1",
          f"--answers={tmp_path}/answers.json", f"--data_dir={data_fixture.write(str(tmp_path))}",
          "--fit_temperature", f"--fit_out={out}"]
  with pytest.raises(SystemExit) as e:
    offline_accept.run(argv)
  assert e.value.code in (0, None)
  text = capsys.readouterr().out
  rows = [x for x in text.splitlines() if x.startswith(f"| {src} | gsm8k (last 1) |")]
  assert [x.split(" | ")[3] for x in rows] == [
      "argmax (T = 0)", "argmax", "sampled", "sampled, fitted t"], text
  fitted = fd.load_drafter(out, target)
  (T, ratios), = fitted.config.draft_temperature
  assert T == 1.0 and len(ratios) == 3 and all(r in offline_accept.RATIO_GRID for r in ratios)
  assert f"  T = 1: {', '.join(f'{r:.3f}' for r in ratios)}" in text
  # T = 0 (and argmax drafts at T > 0) decode exactly as the source drafter does.
  run = lambda d, **kw: fd.generate(target, ["hello there"], max_new_tokens=12, drafter=d,
                                    mode="sequential", stop=[], **kw)
  a, b = run(drafter), run(fitted)
  assert a.token_ids == b.token_ids and a.stats["steps"] == b.stats["steps"]
  sp = fd.SamplingParams(temperature=1.0, draft_sampling=False)
  assert run(drafter, sampling=sp).token_ids == run(fitted, sampling=sp).token_ids
