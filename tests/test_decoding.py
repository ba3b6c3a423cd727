"""Lossless decoding: every mode equals AR at T=0; the engine's mechanics."""

import json

import jax
import numpy as np
import pytest

import flexdraft_jax as fd
from flexdraft_jax.decoding import engine, flex
from flexdraft_jax.drafter import compat
from flexdraft_jax.drafter.model import init_draft_params
from flexdraft_jax.model import transformer
from tests.decoding_util import random_drafter, tiny_target, top2_gap

MODES = [("parallel", 0.0), ("parallel", 0.3), ("sequential", 0.0), ("flex", 0.3)]


def assert_lossless(target, prompts, ref, out):
  """Token-identical, except past a point where the target's top-2 logits tie."""
  for p, r, o in zip(prompts, ref, out):
    if r == o:
      continue
    i = next((k for k, (a, b) in enumerate(zip(r, o)) if a != b), min(len(r), len(o)))
    gap = top2_gap(target, list(p) + r[:i])
    assert gap < 1e-5, f"diverged at {i} with top-2 gap {gap}: {r} vs {o}"


@pytest.fixture(scope="module")
def target():
  return tiny_target()


def prompts_for(batch, seed=0):
  r = np.random.RandomState(seed)
  return [r.randint(2, 64, size=r.randint(1, 12)).tolist() for _ in range(batch)]


@pytest.mark.parametrize("batch, block_size", [(1, 4), (3, 16), (8, 4)])
def test_every_mode_equals_ar(target, batch, block_size):
  prompts = prompts_for(batch, seed=batch)
  drafter = random_drafter(target, block_size=block_size, noise=0.5)
  ref = fd.generate(target, prompts, max_new_tokens=37)
  assert ref.stats["tau"] == 1.0
  for mode, theta in MODES:
    out = fd.generate(target, prompts, max_new_tokens=37, drafter=drafter,
                      mode=mode, threshold=theta, flex_threshold=2)
    assert_lossless(target, prompts, ref.token_ids, out.token_ids)
    assert out.stats["new_tokens"] == ref.stats["new_tokens"]


def test_stop_inside_block_and_rows_finishing_apart(target):
  prompts = prompts_for(5, seed=7)
  long = fd.generate(target, prompts, max_new_tokens=40, stop=[])
  stop = long.token_ids[0][9]  # a token the first row emits mid-way
  ref = fd.generate(target, prompts, max_new_tokens=40, stop=[stop])
  lengths = {len(t) for t in ref.token_ids}
  assert len(lengths) > 1, "rows should finish at different steps"
  assert ref.token_ids[0][-1] == stop and len(ref.token_ids[0]) <= 10
  drafter = random_drafter(target, block_size=8, noise=0.5)
  for mode, theta in MODES:
    out = fd.generate(target, prompts, max_new_tokens=40, stop=[stop],
                      drafter=drafter, mode=mode, threshold=theta)
    assert_lossless(target, prompts, ref.token_ids, out.token_ids)


def test_ragged_batch_equals_each_prompt_alone(target):
  prompts = prompts_for(4, seed=3)
  batch = fd.generate(target, prompts, max_new_tokens=20)
  for p, t in zip(prompts, batch.token_ids):
    assert fd.generate(target, [p], max_new_tokens=20).token_ids[0] == t


def test_cache_decoding_equals_full_forward(target):
  prompt = prompts_for(1, seed=11)[0]
  out = fd.generate(target, [prompt], max_new_tokens=12, stop=[]).token_ids[0]
  logits = np.asarray(fd.target_logits(target, np.asarray([prompt + out])))
  greedy = logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
  assert greedy == out


def test_sampling_is_reproducible_with_a_seed(target):
  prompts = prompts_for(3, seed=5)
  a = fd.generate(target, prompts, max_new_tokens=15, temperature=1.0, seed=3)
  b = fd.generate(target, prompts, max_new_tokens=15, temperature=1.0, seed=3)
  c = fd.generate(target, prompts, max_new_tokens=15, temperature=1.0, seed=4)
  assert a.token_ids == b.token_ids
  assert a.token_ids != c.token_ids


def test_no_recompilation_after_warmup(target):
  drafter = random_drafter(target, block_size=4, noise=0.5)
  prompts = prompts_for(2, seed=1)
  kw = dict(max_new_tokens=200, drafter=drafter, stop=[])
  before = engine.run_chunk._cache_size()
  for mode, theta in MODES:
    fd.generate(target, prompts, mode=mode, threshold=theta, **kw)
  warm = engine.run_chunk._cache_size()
  for mode, theta in MODES:  # other θ, stop tokens, prompts: traced, not static
    fd.generate(target, prompts_for(2, seed=2), mode=mode, threshold=theta / 2,
                **dict(kw, stop=[5]))
  assert engine.run_chunk._cache_size() == warm
  # one compiled chunk per (mode, group bucket[, draft refresh]), not per token
  buckets = len(engine.group_buckets(4, engine.SpecOptions()))
  assert warm - before <= 2 * (2 + buckets)


@pytest.fixture
def cost_cache(tmp_path, monkeypatch):
  """flex's on-disk step-cost cache, in a temporary file."""
  path = str(tmp_path / "step_costs.json")
  monkeypatch.setattr(flex, "COST_CACHE", path)
  return path


def count_chunks(monkeypatch) -> list:
  """Records the mode of every jitted chunk the driver runs."""
  calls, real = [], engine.run_chunk
  def counted(*a, **kw):
    calls.append(kw["mode"])
    return real(*a, **kw)
  monkeypatch.setattr(engine, "run_chunk", counted)
  return calls


@pytest.mark.parametrize("cheapest", ["ar", "sequential", "parallel"])
def test_flex_auto_picks_the_fastest_predicted_mode(target, cost_cache, monkeypatch, cheapest):
  def measure(self, state):  # one mode costs 1 s a step, the others 100 s
    cost = lambda m: 1.0 if m == cheapest else 100.0
    return {"ar": cost("ar"), "sequential": cost("sequential"),
            "parallel": {str(g): cost("parallel") for g in self.buckets}}
  monkeypatch.setattr(flex.Driver, "_measure", measure)
  prompts = prompts_for(3, seed=4)
  drafter = random_drafter(target, block_size=4, noise=0.5)
  ref = fd.generate(target, prompts, max_new_tokens=40)
  calls = count_chunks(monkeypatch)
  out = fd.generate(target, prompts, max_new_tokens=40, drafter=drafter, mode="flex")
  assert_lossless(target, prompts, ref.token_ids, out.token_ids)
  assert {m for m, _ in out.stats["mode_steps"]} == {cheapest}
  assert set(calls) == {cheapest}
  if cheapest == "ar":  # AR steps run as in `ar` mode: one device loop
    assert len(calls) == 1 and out.stats["steps"] == ref.stats["steps"]


def test_flex_auto_measures_once_per_shape(target, cost_cache, monkeypatch):
  prompts = prompts_for(2, seed=6)
  drafter = random_drafter(target, block_size=4, noise=0.5)
  ref = fd.generate(target, prompts, max_new_tokens=24)
  timed = []
  real = flex.Driver._time
  monkeypatch.setattr(flex.Driver, "_time",
                      lambda self, *a, **kw: timed.append(a[1]) or real(self, *a, **kw))
  for _ in range(2):
    out = fd.generate(target, prompts, max_new_tokens=24, drafter=drafter, mode="flex")
    assert_lossless(target, prompts, ref.token_ids, out.token_ids)
  buckets = engine.group_buckets(4, engine.SpecOptions())
  assert sorted(timed) == sorted(["ar", "sequential"] + ["parallel"] * len(buckets))
  with open(cost_cache) as f:
    (costs,) = json.load(f).values()
  assert costs["ar"] > 0 and costs["sequential"] > 0
  assert sorted(costs["parallel"]) == sorted(str(g) for g in buckets)
  assert out.stats["step_costs"] == {"2": costs}  # seconds per step at 2 rows


def test_group_buckets():
  assert engine.group_buckets(16, engine.SpecOptions()) == (2, 3, 5, 9, 16)
  assert engine.group_buckets(4, engine.SpecOptions()) == (2, 3, 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="parallel", threshold=1.5), "θ must be in [0, 1]"),
    (dict(mode="parallel", threshold=-0.1), "θ must be in [0, 1]"),
    (dict(mode="parallel", strategy="nope"), "strategy must be one of"),
    (dict(mode="beam"), "mode must be one of"),
    (dict(mode="flex", flex_threshold="often"), "flex threshold"),
    (dict(max_len=4), "longer than the cache"),
    (dict(mode="parallel", block_size=32), "block size 32"),
])
def test_bad_input_messages(target, kwargs, message):
  drafter = random_drafter(target, block_size=8)
  with pytest.raises(fd.FlexDraftError, match=message.replace("[", r"\[").replace("]", r"\]")):
    fd.generate(target, [[3, 4, 5, 6, 7, 8]], max_new_tokens=4, drafter=drafter, **kwargs)


def test_drafter_for_another_target_is_refused(target):
  other = tiny_target(seed=9)
  drafter = random_drafter(other)
  with pytest.raises(fd.FlexDraftError, match="trained for another target"):
    fd.generate(target, [[3, 4]], max_new_tokens=4, drafter=drafter, mode="parallel")
  wide = tiny_target(vocab=80)
  with pytest.raises(fd.FlexDraftError, match="vocabulary"):
    fd.generate(target, [[3, 4]], max_new_tokens=4, mode="parallel",
                drafter=random_drafter(wide)._replace(target_fingerprint=""))


def test_per_layer_target_decodes_alike_without_a_second_copy(target):
  """A target loaded with layout="layers" is decoded as is (no per-layer copy
  next to a stacked one), fits the same drafters and gives the same tokens."""
  per_layer = target._replace(params=transformer.unstack_layers(target.params))
  assert engine._decoding_params(per_layer.params) is per_layer.params
  drafter = random_drafter(target, noise=0.5)
  compat.check_compatible(drafter, per_layer)
  with pytest.raises(fd.FlexDraftError, match="attention shapes"):
    compat.check_compatible(drafter._replace(params=dict(
        drafter.params, layers={k: v[..., :-1] for k, v in drafter.params["layers"].items()})),
        per_layer)
  # a drafter initialised from either layout is the same
  dp = init_draft_params(per_layer.params, target.config, drafter.config, jax.random.PRNGKey(3))
  ds = init_draft_params(target.params, target.config, drafter.config, jax.random.PRNGKey(3))
  jax.tree.map(np.testing.assert_array_equal, dp, ds)
  prompts = prompts_for(3, seed=5)
  for mode in ("ar", "parallel", "sequential"):
    a = fd.generate(target, prompts, max_new_tokens=20, drafter=drafter, mode=mode)
    b = fd.generate(per_layer, prompts, max_new_tokens=20, drafter=drafter, mode=mode)
    assert a.token_ids == b.token_ids, mode


def test_decoding_copies_of_stacked_trees_are_bounded(target):
  trees = [dict(target.params, embed=target.params["embed"] + 0) for _ in range(6)]
  for t in trees:
    engine._decoding_params(t)
  assert len(engine._unstacked) <= engine._UNSTACKED_MAX
  assert id(trees[-1]) in engine._unstacked and id(trees[0]) not in engine._unstacked
  # a cached tree is served from the cache, not copied again
  assert engine._decoding_params(trees[-1]) is engine._decoding_params(trees[-1])


def test_prompt_longer_than_context_is_refused(target):
  with pytest.raises(fd.FlexDraftError, match="exceeds the model's context"):
    fd.generate(target, [[3] * 1000], max_new_tokens=100)


def test_oracle_drafts_are_accepted_and_parallel_branch_equals_sequential(target):
  """Drafts set to the true continuation with the first k right: parallel commits
  exactly k+1 tokens, and its group-k drafts equal the sequential draft pass."""
  import jax
  import jax.numpy as jnp
  from flexdraft_jax.decoding import parallel, sequential
  from flexdraft_jax.decoding.sampling import SamplingParams
  prompt = [5, 6, 7, 8, 9]
  ref = fd.generate(target, [prompt], max_new_tokens=12, stop=[]).token_ids[0]
  drafter = random_drafter(target, block_size=4, noise=0.5)
  sp = SamplingParams()
  kw = dict(sp=sp, max_new=jnp.int32(12), stop_ids=engine._stop_array(()))
  state = engine._prefill(target.params, drafter.params, jnp.asarray([prompt + [0] * 27]),
                          jnp.asarray([5]), jnp.asarray([True]), jax.random.PRNGKey(0),
                          cfg=target.config, dcfg=drafter.config, S=128, out_len=64,
                          attn_impl="xla", **kw)
  assert int(state.bonus_B[0]) == ref[0]
  for k in (3, 1, 0):
    drafts = list(ref[1:4])
    if k < 3:
      drafts[k] = (drafts[k] + 1) % 64
    st = state._replace(drafts_BxD=jnp.asarray([drafts], jnp.int32))
    par = parallel.parallel_step(target.params, target.config, drafter, st, num_groups=4,
                                 theta=jnp.float32(0), strategy="cumulative_product",
                                 **kw)
    seq = sequential.sequential_step(target.params, target.config, drafter, st, **kw)
    assert int(par.length_B[0]) == 5 + k + 1
    assert np.asarray(par.out_BxO)[0, :k + 2].tolist() == ref[:k + 2]
    assert int(par.bonus_B[0]) == ref[k + 1]
    np.testing.assert_array_equal(par.drafts_BxD, seq.drafts_BxD)
    np.testing.assert_allclose(par.conf_BxD, seq.conf_BxD, rtol=1e-5)
