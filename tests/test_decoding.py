"""Lossless decoding: every mode equals AR at T=0; the engine's mechanics."""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexdraft_jax as fd
from flexdraft_jax.decoding import (call_stats, chunk, decode_params, driver, flex, flex_costs,
                                    inputs, step_costs)
from flexdraft_jax.drafter import compat
from flexdraft_jax.drafter.model import init_draft_params
from flexdraft_jax.model import pytree, transformer
from flexdraft_jax.evaluation.cells import check_lossless
from tests.decoding_util import bigram_drafter, random_drafter, tiny_target, vocab_drafter

MODES = [("parallel", 0.0), ("parallel", 0.3), ("sequential", 0.0), ("flex", 0.3)]


def assert_lossless(target, prompts, ref, out):
  """Token-identical, except past a point where the target's top-2 logits tie
  (within 1e-5: float rounding may pick either) — the sweep's own check."""
  report = check_lossless(target, [[r] for r in ref], [[o] for o in out],
                          [[p] for p in prompts], tol=1e-5)
  assert report["mismatched"] == 0 and report["identical"] + report["ties"] == len(ref), \
      report["details"]


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
    out = fd.generate(target, prompts, max_new_tokens=37, drafter=drafter, mode=mode,
                      speculation=fd.SpecOptions(threshold=theta, flex_threshold=2))
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
    out = fd.generate(target, prompts, max_new_tokens=40, stop=[stop], drafter=drafter,
                      mode=mode, speculation=fd.SpecOptions(threshold=theta))
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
  a = fd.generate(target, prompts, max_new_tokens=15,
                  sampling=fd.SamplingParams(temperature=1.0), seed=3)
  b = fd.generate(target, prompts, max_new_tokens=15,
                  sampling=fd.SamplingParams(temperature=1.0), seed=3)
  c = fd.generate(target, prompts, max_new_tokens=15,
                  sampling=fd.SamplingParams(temperature=1.0), seed=4)
  assert a.token_ids == b.token_ids
  assert a.token_ids != c.token_ids


def test_no_recompilation_after_warmup(target):
  drafter = random_drafter(target, block_size=4, noise=0.5)
  prompts = prompts_for(2, seed=1)
  kw = dict(max_new_tokens=200, drafter=drafter, stop=[])
  before = chunk.run_chunk._cache_size()
  for mode, theta in MODES:
    fd.generate(target, prompts, mode=mode, speculation=fd.SpecOptions(threshold=theta),
                **kw)
  warm = chunk.run_chunk._cache_size()
  for mode, theta in MODES:  # other θ, stop tokens, prompts: traced, not static
    fd.generate(target, prompts_for(2, seed=2), mode=mode,
                speculation=fd.SpecOptions(threshold=theta / 2), **dict(kw, stop=[5]))
  assert chunk.run_chunk._cache_size() == warm
  # one compiled chunk per (mode, group bucket[, draft refresh]), not per token
  buckets = len(chunk.group_buckets(4, fd.SpecOptions()))
  assert warm - before <= 2 * (2 + buckets)


@pytest.fixture
def cost_cache(tmp_path, monkeypatch):
  """flex's on-disk step-cost cache, in a temporary file."""
  path = str(tmp_path / "step_costs.json")
  monkeypatch.setenv("FLEXDRAFT_COST_CACHE", path)
  monkeypatch.setattr(step_costs, "_COSTS_IN_MEMORY", {})
  return path


def count_chunks(monkeypatch) -> list:
  """Records the mode of every jitted chunk the driver runs."""
  calls, real = [], chunk.run_chunk
  def counted(*a, **kw):
    calls.append(kw["mode"])
    return real(*a, **kw)
  monkeypatch.setattr(chunk, "run_chunk", counted)
  return calls


@pytest.mark.parametrize("cheapest", ["ar", "sequential", "parallel"])
def test_flex_auto_picks_the_fastest_predicted_mode(target, cost_cache, monkeypatch, cheapest):
  def measure(self, state, B, S, again=False):  # one mode 1 s a step, the others 100 s
    cost = lambda m: 1.0 if m == cheapest else 100.0
    return {"ar": cost("ar"),
            **{m: {str(k): cost(m) for k in self.buckets} for m in ("sequential", "parallel")}}
  monkeypatch.setattr(flex_costs.StepCosts, "measure", measure)
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
  real = driver.Driver._time
  monkeypatch.setattr(driver.Driver, "_time",
                      lambda self, *a, **kw: timed.append(a[1]) or real(self, *a, **kw))
  # (a tiny model's steps cost about a dispatch: its chunks may run far off the
  # timed costs, and timing again is another test's)
  monkeypatch.setattr(flex_costs, "RETIME", float("inf"))
  for _ in range(2):
    out = fd.generate(target, prompts, max_new_tokens=24, drafter=drafter, mode="flex")
    assert_lossless(target, prompts, ref.token_ids, out.token_ids)
  buckets = chunk.group_buckets(4, fd.SpecOptions())
  # AR, and each mode at the shortest and longest verify length, round-robin
  # TIMING_ROUNDS times in the first run only
  plan = ["ar", "sequential", "sequential", "parallel", "parallel"]
  assert timed == plan * flex_costs.TIMING_ROUNDS
  with open(cost_cache) as f:
    (costs,) = json.load(f).values()
  assert costs["ar"] > 0 and costs["measured_k"] == [buckets[0], buckets[-1]]
  for mode in ("sequential", "parallel"):
    assert sorted(costs[mode]) == sorted(str(g) for g in buckets)
    lo, mid, hi = (costs[mode][str(k)] for k in buckets)
    assert min(lo, hi) <= mid <= max(lo, hi)  # interpolated between the two
  assert out.stats["step_costs"] == {"2": costs}  # seconds per step at 2 rows
  (choice,) = out.stats["flex_choices"].values()
  assert set(choice["tokens_per_s"]) == {"ar"} | {
      f"{m}:{k}" for m in ("sequential", "parallel") for k in buckets}


def test_group_buckets():
  assert chunk.group_buckets(16, fd.SpecOptions()) == (2, 3, 4, 8, 16)
  assert chunk.group_buckets(8, fd.SpecOptions()) == (2, 3, 4, 8)
  assert chunk.group_buckets(3, fd.SpecOptions()) == (2, 3)
  assert chunk.group_buckets(4, fd.SpecOptions()) == (2, 3, 4)


@pytest.mark.parametrize("mode, spec, runtime, message", [
    ("parallel", dict(threshold=1.5), {}, "θ must be in [0, 1]"),
    ("parallel", dict(threshold=-0.1), {}, "θ must be in [0, 1]"),
    ("parallel", dict(strategy="nope"), {}, "strategy must be one of"),
    ("beam", {}, {}, "mode must be one of"),
    ("flex", dict(flex_threshold="often"), {}, "flex threshold"),
    ("ar", {}, dict(max_len=4), "longer than the cache"),
    ("parallel", dict(block_size=32), {}, "block size 32"),
    ("sequential", dict(draft_dtype="float16"), {}, "draft_dtype must be one of"),
])
def test_bad_input_messages(target, mode, spec, runtime, message):
  drafter = random_drafter(target, block_size=8)
  with pytest.raises(fd.FlexDraftError, match=message.replace("[", r"\[").replace("]", r"\]")):
    fd.generate(target, [[3, 4, 5, 6, 7, 8]], max_new_tokens=4, drafter=drafter, mode=mode,
                speculation=fd.SpecOptions(**spec), runtime=fd.RuntimeOptions(**runtime))


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
  per_layer = target._replace(params=pytree.unstack_layers(target.params))
  assert decode_params.decoding_params(per_layer.params) is per_layer.params
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
    decode_params.decoding_params(t)
  assert len(decode_params._unstacked) <= decode_params._UNSTACKED_MAX
  assert id(trees[-1]) in decode_params._unstacked and id(trees[0]) not in decode_params._unstacked
  # a cached tree is served from the cache, not copied again
  assert decode_params.decoding_params(trees[-1]) is decode_params.decoding_params(trees[-1])


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
  kw = dict(sp=sp, max_new=jnp.int32(12), stop_ids=inputs.stop_array(()))
  state = chunk.prefill_batch(target.params, drafter.params, jnp.asarray([prompt + [0] * 27]),
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


def test_draft_vocabulary_maps_drafts_back_to_token_ids():
  target = tiny_target(vocab=16, eos=0, scale=0.5, seed=4)
  full = bigram_drafter(target)  # drafts the target's favourite successor
  succ = set(np.asarray(fd.target_logits(target, np.arange(16)[:, None]))[:, 0]
             .argmax(-1).tolist())
  rest = [t for t in range(16) if t not in succ]
  # Shuffled, so a draft-vocabulary index is not the token id it stands for.
  ids = np.random.RandomState(0).permutation(sorted(succ) + rest[:2])
  small = vocab_drafter(full, ids)
  assert small.params["calib"]["w2"].shape == (16, len(ids))
  prompts = prompts_for(4)
  prompts = [[t % 16 for t in p] for p in prompts]
  ref = fd.generate(target, prompts, max_new_tokens=24, stop=[])
  for mode in ("sequential", "parallel"):
    a = fd.generate(target, prompts, max_new_tokens=24, stop=[], drafter=full, mode=mode)
    b = fd.generate(target, prompts, max_new_tokens=24, stop=[], drafter=small, mode=mode)
    assert_lossless(target, prompts, ref.token_ids, a.token_ids)
    assert_lossless(target, prompts, ref.token_ids, b.token_ids)
    assert a.stats["tau"] > 1.05  # drafts get accepted
    assert b.stats["tau"] == a.stats["tau"]   # the very same drafts
  # Without the successors they can never be drafted: fewer accepted, still lossless.
  none = vocab_drafter(full, rest)
  c = fd.generate(target, prompts, max_new_tokens=24, stop=[], drafter=none,
                  mode="sequential")
  assert_lossless(target, prompts, ref.token_ids, c.token_ids)
  assert c.stats["tau"] < a.stats["tau"]


@pytest.mark.parametrize("mode", ["sequential", "parallel", "flex"])
def test_every_verify_length_equals_ar(target, mode):
  prompts = prompts_for(3, seed=8)
  drafter = random_drafter(target, block_size=8, noise=0.5)
  ref = fd.generate(target, prompts, max_new_tokens=30)
  buckets = chunk.group_buckets(8, fd.SpecOptions())
  assert buckets == (2, 3, 4, 8)
  for k in buckets:
    out = fd.generate(target, prompts, max_new_tokens=30, drafter=drafter, mode=mode,
                      speculation=fd.SpecOptions(verify_len=k, flex_threshold=1))
    assert_lossless(target, prompts, ref.token_ids, out.token_ids)
    # every step verified a block of k positions: at most k tokens per step
    assert {g for g, _ in out.stats["group_counts"]} == {k}
    assert len(out.stats["accept_hist"]) == 9 and sum(out.stats["accept_hist"][k + 1:]) == 0


@pytest.mark.parametrize("mode", ["sequential", "parallel", "flex"])
def test_bf16_draft_pass_is_lossless_and_drafts_nearly_alike(target, mode):
  """The draft pass reading bf16 weights (`draft_dtype`) changes drafts at
  most slightly and outputs not at all."""
  tgt = tiny_target(vocab=16, eos=0, scale=0.5, seed=4)
  drafter = bigram_drafter(tgt, block_size=4)
  prompts = [[t % 16 for t in p] for p in prompts_for(4, seed=3)]
  ref = fd.generate(tgt, prompts, max_new_tokens=24, stop=[])
  out = {}
  for dtype in ("bfloat16", "target"):
    out[dtype] = fd.generate(tgt, prompts, max_new_tokens=24, stop=[], drafter=drafter,
                             mode=mode, speculation=fd.SpecOptions(
                                 draft_dtype=dtype,
                                 flex_threshold=1 if mode == "flex" else "auto"))
    assert_lossless(tgt, prompts, ref.token_ids, out[dtype].token_ids)
    assert out[dtype].stats["draft_dtype"] == dtype
  assert out["target"].stats["tau"] > 1.2  # drafts that get accepted ...
  # ... and, in bf16, accepted about as often
  assert abs(out["bfloat16"].stats["tau"] - out["target"].stats["tau"]) < 0.1


def test_narrowed_draft_params_and_the_default_where_the_kernel_runs(target, monkeypatch):
  from flexdraft_jax.drafter.model import narrowed_dtype
  from flexdraft_jax.kernels import cpu_matmul
  from flexdraft_jax.decoding import state as state_lib
  cfg = target.config
  drafter = random_drafter(target, block_size=4, noise=0.5)
  full = decode_params.draft_decoding_params(target.params, cfg, drafter.params)
  bf16 = decode_params.draft_decoding_params(target.params, cfg, drafter.params, jnp.bfloat16)
  assert decode_params.draft_decoding_params(target.params, cfg, drafter.params,
                                             jnp.bfloat16) is bf16  # made once
  assert narrowed_dtype(full) == "" and narrowed_dtype(bf16) == "bfloat16"
  L, n = drafter.config.num_layers, cfg.num_layers
  assert len(bf16["deep_mlp"]) == L
  for key in ("gate", "up", "down"):  # the deep layers' MLP, [out, in], bf16
    np.testing.assert_array_equal(
        bf16["deep_mlp"][0][key + "_t"],
        pytree.layer_leaf(target.params, key, n - L).T.astype(jnp.bfloat16))
  assert bf16["layers"][0]["q_t"].dtype == jnp.bfloat16
  assert bf16["calib"]["w1_t"].dtype == jnp.bfloat16 and bf16["calib"]["b1"].dtype == jnp.float32
  assert target.params["embed"].dtype == jnp.float32  # the target's own stay as they are
  # the draft pass: hidden states within bf16's precision of the full one
  B, S = 2, 128
  cache = pytree.KVCache.zeros(cfg, B, S, jnp.float32)
  prompt = jnp.asarray([[5, 9, 12, 7], [3, 4, 8, 1]])
  _, _, cache = transformer.forward(target.params, cfg, cache, prompt,
                                    jnp.broadcast_to(jnp.arange(4), (B, 4)))
  per_layer = decode_params.decoding_params(target.params)
  hm = {}
  for name, dp in (("full", full), ("bf16", bf16)):
    d = drafter._replace(params=dp)
    hm[name] = np.asarray(state_lib.deep_pass(per_layer, cfg, d, cache, jnp.asarray([4, 4]),
                                              jnp.asarray([6, 2]), "xla"))
  scale = np.abs(hm["full"]).max()
  assert 0 < np.abs(hm["bf16"] - hm["full"]).max() < 0.05 * scale
  # "auto": bf16 where the CPU kernel runs an fp32 target, else the target's dtype
  want = jnp.bfloat16 if cpu_matmul.available() else None
  assert decode_params.resolve_draft_dtype("auto", target.params) == want
  assert decode_params.resolve_draft_dtype("target", target.params) is None
  monkeypatch.setenv("FLEXDRAFT_CPU_MATMUL", "0")
  assert decode_params.resolve_draft_dtype("auto", target.params) is None
  assert decode_params.resolve_draft_dtype("bfloat16", target.params) == jnp.bfloat16


def test_short_verify_length_keeps_accepting_the_same_drafts():
  # Drafting runs the trained block whatever k is: the first k - 1 drafts are
  # the same, so a k = 2 run accepts exactly where the first draft is right.
  target = tiny_target(vocab=16, eos=0, scale=0.5, seed=4)
  drafter = bigram_drafter(target, block_size=4)
  prompts = [[t % 16 for t in p] for p in prompts_for(4)]
  ref = fd.generate(target, prompts, max_new_tokens=24, stop=[])
  full = fd.generate(target, prompts, max_new_tokens=24, stop=[], drafter=drafter,
                     mode="sequential")
  short = fd.generate(target, prompts, max_new_tokens=24, stop=[], drafter=drafter,
                      mode="sequential", speculation=fd.SpecOptions(verify_len=2))
  assert short.token_ids == full.token_ids == ref.token_ids
  assert 1.05 < short.stats["tau"] <= full.stats["tau"]
  with pytest.raises(fd.FlexDraftError, match="exceeds the block size"):
    fd.generate(target, prompts, drafter=drafter, mode="sequential",
                speculation=fd.SpecOptions(verify_len=5))


def _driver(bs=8, verify_len=None):
  drafter = types.SimpleNamespace(config=types.SimpleNamespace(block_size=bs, bonus_input=False,
                                                               drafts_blind=True,
                                                               rescores=False))
  opts = fd.SpecOptions(verify_len=verify_len)
  _, buckets = chunk.verify_buckets(bs, opts)
  return flex.FlexPolicy(None, drafter, opts, buckets, time_step=None)


def _conf_state(conf, n_out=None):
  conf = np.asarray(conf, np.float32)
  conf = conf[None] if conf.ndim == 1 else conf
  B = conf.shape[0]
  n_out = np.zeros(B, np.int32) if n_out is None else np.asarray(n_out, np.int32)
  return types.SimpleNamespace(conf_BxD=conf, done_B=np.zeros(B, bool), n_out_B=n_out)


def test_row_tau_is_what_the_batch_s_last_row_gains():
  # A batch ends with its slowest row: a speculative step is worth what it
  # gains the row with the most steps left, not the rows' average.
  d = _driver()
  d.max_new = 64
  same = _conf_state([[0.5] * 7] * 2)
  assert d.row_tau(same, 2.0) == pytest.approx(2.0)  # alike rows: τ(k) itself
  assert d.row_tau(_conf_state([0.9] * 7), 2.5) == 2.5  # one row: τ(k)
  # row 1 drafts with lower confidence: it sets the pace (τ_i = 1 + (τ - 1) g_i)
  mixed = _conf_state([[0.8] * 7, [0.2] * 7])
  tc = 1 + np.cumprod(np.array([[0.8] * 7, [0.2] * 7]), axis=1).sum(1)
  g = (tc - 1) / (tc.mean() - 1)
  assert d.row_tau(mixed, 2.0) == pytest.approx(1 + g[1])
  # after speculative chunks, rows' own progress replaces the confidence: row 0
  # made 3 tokens a step, row 1 one, the two rows 2 a step on average; row 1
  # also has the most tokens left
  d.row_tok, d.row_steps = np.array([24.0, 8.0]), np.array([8.0, 8.0])
  d.row_mean = np.array([16.0, 16.0])
  ahead = _conf_state([[0.5] * 7] * 2, n_out=[40, 16])
  tau_i = 1 + (2.0 - 1) * np.clip((np.array([3.0, 1.0]) - 1) / (2.0 - 1), 0, 3)
  left = np.array([24, 48])
  assert d.row_tau(ahead, 2.0) == pytest.approx(left.max() / (left / tau_i).max())
  assert d.row_tau(ahead, 2.0) == pytest.approx(1.0)  # row 1 gains nothing


def test_row_tau_of_a_row_left_alone_is_its_own():
  # Two rows decode speculative chunks side by side; row 0 accepts 3 tokens a
  # step, row 1 1.5. Once row 0 is done, τ(k)'s counts still hold row 0's
  # steps: the row left decodes at its own pace, (1.5 - 1) / (2.25 - 1) of τ(k)'s
  # gain, not at τ(k) (batch 2 here: τ(4) 1.97 predicted, 1.2 decoded).
  d = _driver()
  d.max_new = 64
  state = _conf_state([[0.5] * 7] * 2, n_out=[0, 0])
  d._see_rows(state)
  for n in (1, 2):
    d._last_chunk = ("sequential", 8)
    state = _conf_state([[0.5] * 7] * 2, n_out=[24 * n, 12 * n])
    d._see_rows(state)
  assert d.row_tok[1] / d.row_steps[1] == pytest.approx(1.5)
  assert d.row_mean[1] / d.row_steps[1] == pytest.approx(2.25)
  state.done_B = np.array([True, False])
  assert d.row_tau(state, 2.0) == pytest.approx(1 + (1.5 - 1) / (2.25 - 1))
  # rows that accept alike: τ(k) itself, alone or not
  d.row_tok = d.row_mean.copy()
  assert d.row_tau(state, 2.0) == pytest.approx(2.0)


def test_tau_by_length_from_counts_and_confidence():
  d = _driver()
  assert d.cost_model.buckets == (2, 3, 4, 8)
  state = _conf_state([0.5] * 7)
  # Nothing verified yet: the drafts' confidences. τ(k) = 1 + Σ_{i<k} 0.5^i
  tau = d.tau_by_length(state)
  assert tau[2] == pytest.approx(1.5) and tau[8] == pytest.approx(2 - 0.5 ** 7)
  d._prior_c = d._conf_ratio()  # as a choice on this state sets it
  # 100 steps at k = 3: 80 accepted slot 1, 40 of those slot 2 (hist index a + 1)
  d.count_acceptance(np.array([0, 20, 40, 40, 0, 0, 0, 0, 0]), 3)
  assert d.verified[1:3].tolist() == [100, 80] and d.accepted[1:3].tolist() == [80, 40]
  assert d.expected[1:3].tolist() == [50, 40]  # what confidence 0.5 expected of them
  tau = d.tau_by_length(state)
  # each verified slot: its counts plus PRIOR_WEIGHT steps of the prior, the
  # confidence × how well it has predicted acceptance on slots 2.. (40 accepted
  # of 80 verified at confidence 0.5: as predicted)
  prior, w = 0.5 * (40 / 40), flex.PRIOR_WEIGHT
  r1, r2 = (80 + w * prior) / (100 + w), (40 + w * prior) / (80 + w)
  assert tau[2] == pytest.approx(1 + r1) and tau[3] == pytest.approx(1 + r1 + r1 * r2)
  # slots 3.. never verified: the prior alone
  assert tau[4] == pytest.approx(1 + r1 + r1 * r2 * (1 + prior))
  assert tau[8] == pytest.approx(1 + r1 + r1 * r2 * sum(prior ** i for i in range(6)))
  # many more steps: the counts' own rates (0.8, then 0.5) decide
  d.count_acceptance(np.array([0, 20, 40, 40, 0, 0, 0, 0, 0]) * 1000, 3)
  assert d.tau_by_length(state)[3] == pytest.approx(1 + 0.8 + 0.8 * 0.5, abs=2e-3)
  assert _driver(verify_len=5).cost_model.buckets == (2, 3, 4, 5)


def test_tau_prior_scale_is_fitted_on_slots_past_the_first():
  # Slot 1 runs overconfident (0.9, accepted half the time) while the later
  # slots accept as confident as they are: slot 1's own counts correct it, and
  # the never-verified slots keep their confidence unscaled.
  d = _driver()
  state = _conf_state([0.9] + [0.6] * 6)
  d._see_confidence(state)
  d._prior_c = d._conf_ratio()  # as a choice on this state sets it
  # 100 steps at k = 3: slot 1 accepted 50, slot 2 30 of those 50 (0.6)
  d.count_acceptance(np.array([0, 50, 20, 30, 0, 0, 0, 0, 0]), 3)
  tau = d.tau_by_length(state)
  w = flex.PRIOR_WEIGHT
  r1, r2 = (50 + w * 0.9) / (100 + w), (30 + w * 0.6) / (50 + w)
  assert tau[8] == pytest.approx(1 + r1 + r1 * r2 * sum(0.6 ** i for i in range(6)))
  # (fitted on every slot the scale would be 80 / 108 and slot 3.. would read 0.44)


def test_tau_prior_is_the_confidence_given_the_slots_before_were_accepted():
  # Confident drafts come in runs: of two choices, one block confident
  # throughout and one not, the chance that slot 2 is accepted given slot 1
  # was is the ratio of their mean survivals Π conf, not slot 2's mean
  # confidence (0.5 here, which would undercount the long runs).
  d = _driver()
  ks = d.cost_model.buckets
  d.cost_model.costs = {"ar": 1.0, "sequential": {str(k): 1.0 for k in ks},
                        "parallel": {str(k): 1.0 for k in ks}}
  d.choose(_conf_state([0.9] * 7), 1, 8, B=1, S=64)
  d.choose(_conf_state([0.1] * 7), 1, 8, B=1, S=64)
  wt = np.array([flex.ACCEPT_DECAY, 1.0])  # the older choice weighs less
  surv = [float(wt @ np.array([0.9, 0.1]) ** i) / wt.sum() for i in range(1, 8)]
  assert d.tau_by_length(_conf_state([0.5] * 7))[8] == pytest.approx(1 + sum(surv))
  cond2 = surv[1] / surv[0]
  assert cond2 > 0.7  # 0.82 (against a mean confidence of 0.37)


def test_acceptance_decays_only_in_the_slots_a_chunk_verified():
  d = _driver()
  # a chunk at k = 8: 10 steps, every draft accepted
  d.observe(np.array([0] * 8 + [10]), "sequential", 8, B=1, steps=10, seconds=1.0)
  assert d.verified[1:].tolist() == [10] * 7 and d.accepted[1:].tolist() == [10] * 7
  # then at k = 3, nothing accepted: slots 1-2 decay and count it, 3-7 keep k = 8's
  d.observe(np.array([0, 10] + [0] * 7), "sequential", 3, B=1, steps=10, seconds=1.0)
  decay = flex.ACCEPT_DECAY ** (10 / flex.DECAY_STEPS)  # per step, not per chunk
  assert d.verified[1:3].tolist() == [10 * decay + 10, 10 * decay]
  assert d.accepted[1:3].tolist() == [10 * decay, 10 * decay]
  assert d.verified[3:].tolist() == [10] * 5 and d.accepted[3:].tolist() == [10] * 5
  # an AR chunk changes no slot
  d.observe(np.array([10] + [0] * 8), "ar", 0, B=1, steps=10, seconds=1.0)
  assert d.verified[3:].tolist() == [10] * 5


def test_prior_scale_holds_acceptance_to_the_prior_each_chunk_was_chosen_on():
  # At T = 1 an argmax draft is accepted with the target's p_T(draft), about
  # half its confidence: the scale learns that from what the prior expected
  # when each chunk was chosen, whatever the drafts' confidence is now.
  d = _driver()
  ks = d.cost_model.buckets
  d.cost_model.costs = {"ar": 1.0, "sequential": {str(k): 1.0 for k in ks},
                        "parallel": {str(k): 1.0 for k in ks}}
  d.choose(_conf_state([0.8] * 7), 1, 8, B=1, S=64)
  assert d._prior_c[1:].tolist() == pytest.approx([0.8] * 7)
  # 100 steps at k = 3: slot 1 accepted 40 times, slot 2 16 of those 40 (0.4
  # each, where 0.8 was expected)
  d.observe(np.array([0, 60, 24, 16, 0, 0, 0, 0, 0]), "sequential", 3, B=1, steps=100,
            seconds=100.0)  # (as timed: 1 s a step)
  assert d.expected[1:3].tolist() == pytest.approx([80, 32])
  w = flex.SCALE_WEIGHT
  want = (16 + w * 1.0) / (32 + w)  # fitted on slot 2 (40 verifications)
  assert d.prior_scale() == pytest.approx(want)
  # drafts now far less confident: the counts keep the prior they were held to
  d.choose(_conf_state([0.2] * 7), 1, 8, B=1, S=64)
  assert d.prior_scale() == pytest.approx(want)
  assert d.tau_by_length(_conf_state([0.8] * 7))[8] < 1 + 0.8  # (τ(8) at 0.8: 4.2)
  # older counts fade per step, not per chunk: 16 one-step chunks as one of 16
  assert d._decay(1) ** flex.DECAY_STEPS == pytest.approx(flex.ACCEPT_DECAY)


def test_flex_starts_where_the_last_request_with_that_drafter_and_temperature_ended():
  target = types.SimpleNamespace(fingerprint="t")
  drafter = types.SimpleNamespace(config=types.SimpleNamespace(
      block_size=8, bonus_input=False, drafts_blind=True, rescores=False))
  opts = fd.SpecOptions()
  _, buckets = chunk.verify_buckets(8, opts)
  make = lambda t, sampled=False: flex.FlexPolicy(target, drafter, opts, buckets,
                                                  time_step=None, temperature=t,
                                                  sampled_drafts=sampled)
  assert make(0.0).scale0 == 1.0  # nothing seen in this process: confidence as it is
  first = make(1.0)  # ... at T = 1 an argmax draft is accepted with p_T(draft)
  assert first.scale0 == pytest.approx(1 - flex.TEMPERATURE_SCALE)
  first._prior_c = np.full(8, 0.8)
  first.observe(np.array([0, 60, 24, 16, 0, 0, 0, 0, 0]), "sequential", 3, B=1, steps=100,
                seconds=1.0)
  fitted = first.prior_scale()
  assert fitted < 0.8
  assert make(1.0).scale0 == pytest.approx(fitted)  # the next request at T = 1
  assert make(0.7).scale0 == pytest.approx(1 - flex.TEMPERATURE_SCALE * 0.49)  # its own
  # Sampled drafts are accepted where q and p_T overlap: a scale of their own.
  assert make(1.0, sampled=True).scale0 == pytest.approx(1 - flex.TEMPERATURE_SCALE_SAMPLED)
  assert flex.TEMPERATURE_SCALE_SAMPLED < flex.TEMPERATURE_SCALE


def test_tau_prior_is_the_mean_confidence_over_choices():
  # One state's drafts are a noisy sample: the prior is the decayed mean of
  # the confidences seen at each choice, not the latest alone.
  d = _driver()
  ks = d.cost_model.buckets
  d.cost_model.costs = {"ar": 1.0, "sequential": {str(k): 1.0 for k in ks},
                        "parallel": {str(k): 1.0 for k in ks}}
  d.choose(_conf_state([0.9] * 7), 1, 8, B=1, S=64)
  low = _conf_state([0.1] * 7)
  mean = (flex.ACCEPT_DECAY * 0.9 + 0.1) / (flex.ACCEPT_DECAY + 1)
  assert d.tau_by_length(low)[2] == pytest.approx(1.9)  # not seen by a choice yet
  d.choose(low, 1, 8, B=1, S=64)
  assert d.tau_by_length(low)[2] == pytest.approx(1 + mean)


def test_flex_probes_speculation_again_after_ar_when_it_came_close():
  d = _driver(verify_len=2)
  d.cost_model.modes = ("sequential",)
  d.cost_model.costs = {"ar": 1.0, "sequential": {"2": 1.1}}
  # τ(2) = 1.1 at 1.1x AR's cost: as fast as AR, under the margin (a probe
  # predicted to lose nothing is due after AR_STRETCH steps)
  close = _conf_state([0.1] + [0.5] * 6)
  assert d.choose(close, 1, 2, B=1, S=64) == ("ar", 0)
  # AR runs until the next probe is due, then one short probe chunk
  assert d.chunk_steps(1, "ar", 0, 1000) == flex.AR_STRETCH
  assert not d.sticky_ar("sequential") and d.sticky_ar("ar")
  d.observe(np.zeros(9), "ar", 0, B=1, steps=flex.AR_STRETCH,
            seconds=float(flex.AR_STRETCH))  # AR as fast as timed
  assert not d.sticky_ar("ar")
  assert d.choose(close, 1, 2, B=1, S=64) == ("sequential", 2)
  assert d.stats()["flex_choices"]["1"]["probe"]
  assert d.chunk_steps(1, "sequential", 2, 16) == flex.PROBE_STEPS
  # it lost: AR again, for twice as long before the next probe
  assert d.choose(close, 1, 2, B=1, S=64) == ("ar", 0)
  assert d.chunk_steps(1, "ar", 0, 1000) == 2 * flex.AR_STRETCH
  # far behind AR: no probes at all, AR runs to the end in one loop
  far = _conf_state([0.5] * 7)  # τ(2) = 1.5 at twice AR's cost: 0.75x AR
  d2 = _driver(verify_len=2)
  d2.cost_model.modes = d.cost_model.modes
  d2.cost_model.costs = {"ar": 1.0, "sequential": {"2": 2.0}}
  assert d2.choose(far, 1, 2, B=1, S=64) == ("ar", 0)
  assert d2.chunk_steps(1, "ar", 0, 1000) == 1000
  d2.observe(np.zeros(9), "ar", 0, B=1, steps=1000, seconds=1000.0)
  assert d2.sticky_ar("ar")


def test_flex_probes_later_where_a_probe_could_lose_more():
  # τ(2) = 1.277 at 1.5x AR's cost: 0.85x AR, close enough to probe, but a
  # 4-step probe that gained nothing would lose 4 · 0.5 = 2 AR steps: it waits
  # until that is PROBE_BUDGET of the AR steps since the last probe.
  d = _driver(verify_len=2)
  d.cost_model.modes = ("sequential",)
  d.cost_model.costs = {"ar": 1.0, "sequential": {"2": 1.5}}
  behind = _conf_state([0.277] + [0.5] * 6)
  assert d.choose(behind, 1, 2, B=1, S=64) == ("ar", 0)
  wait = int(np.ceil(flex.PROBE_STEPS * 0.5 / flex.PROBE_BUDGET))
  assert wait > flex.AR_STRETCH
  assert d.chunk_steps(1, "ar", 0, 1000) == wait
  assert d.stats()["flex_choices"]["1"]["next_probe_after_ar_steps"] == wait
  d.observe(np.zeros(9), "ar", 0, B=1, steps=flex.AR_STRETCH,
            seconds=float(flex.AR_STRETCH))
  assert d.sticky_ar("ar")  # AR_STRETCH steps are not enough here
  d.observe(np.zeros(9), "ar", 0, B=1, steps=wait - flex.AR_STRETCH,
            seconds=float(wait - flex.AR_STRETCH))
  assert not d.sticky_ar("ar")
  assert d.choose(behind, 1, 2, B=1, S=64) == ("sequential", 2)
  assert d.stats()["flex_choices"]["1"]["probe"]


def test_flex_corrects_step_costs_with_what_chunks_took():
  d = _driver()
  ks = d.cost_model.buckets
  d.cost_model.costs = {"ar": 1.0, "sequential": {str(k): 1.0 + 0.1 * k for k in ks},
                        "parallel": {str(k): 1.0 + 0.1 * k for k in ks}}
  state = _conf_state([0.9] * 7)
  mode, k = d.choose(state, 1, 8, B=1, S=64)
  assert mode != "ar"
  hist = np.zeros(9, np.int64)
  hist[1] = 16  # 16 row-steps, one token each
  # A chunk during which something compiled does not count.
  d.observe(hist, mode, k, B=1, steps=16, seconds=1000.0, compiled=True)
  assert d.cost_model.cost_scale(1, mode) == 1.0
  # Then the chunks take 3x what the measured cost predicted: flex falls back
  # (with costs already timed again: see the next test).
  d.cost_model.retimed.add(1)
  d.observe(hist, mode, k, B=1, steps=16, seconds=3 * 16 * d.cost_model.costs[mode][str(k)])
  assert d.cost_model.cost_scale(1, mode) == pytest.approx(3.0)
  assert d.choose(state, 1, 8, B=1, S=64) == ("ar", 0)
  why = d.stats()["flex_choices"]["1"]
  assert why["measured_tokens_per_s"] == {f"{mode}:{k}": pytest.approx(16 / 3 / (
      16 * d.cost_model.costs[mode][str(k)]), abs=0.01)}
  assert why["cost_scale"][mode] == pytest.approx(3.0)
  # AR has not run: it borrows the machine's slowdown, but only up to
  # MACHINE_DRIFT (3x is the mode's own)...
  assert d.cost_model.cost_scale(1, "ar") == pytest.approx(flex_costs.MACHINE_DRIFT)
  # ... and once it has chunks of its own, they decide.
  d.observe(hist, "ar", 0, B=1, steps=16, seconds=16 * 1.1)
  assert d.cost_model.cost_scale(1, "ar") == pytest.approx(1.1)
  # Other batch shapes keep their own corrections.
  assert d.cost_model.cost_scale(4, mode) == 1.0


def test_flex_times_the_steps_again_where_decoding_ran_far_off_them():
  """Costs timed during a busy spell (k = 8 timed 2.2x its real cost, k = 2
  1.3x) keep k = 8 away; once a mode's chunks run beyond RETIME of the timed
  costs over RETIME_STEPS steps, flex times the steps again — once per batch
  shape."""
  real = {("ar", 0): 1.0, ("sequential", 2): 1.3, ("sequential", 8): 1.6}
  busy = {("ar", 0): 1.0, ("sequential", 2): 1.7, ("sequential", 8): 3.5}
  timings = []

  def time_step(state, mode, k):
    timings.append((mode, k))
    return (busy if len(timings) <= 3 * flex_costs.TIMING_ROUNDS else real)[(mode, k)]

  drafter = types.SimpleNamespace(
      config=types.SimpleNamespace(block_size=8, bonus_input=True, drafts_blind=False,
                                   num_layers=2, draft_vocab=0, rescores=False), params={})
  opts = fd.SpecOptions(cost_cache=None)
  _, buckets = chunk.verify_buckets(8, opts)
  d = flex.FlexPolicy(types.SimpleNamespace(fingerprint="retime-test"), drafter, opts,
                      buckets, time_step)
  state = _conf_state([0.8] * 7)
  mode, k = d.choose(state, 1, 8, B=1, S=64)
  assert len(timings) == 3 * flex_costs.TIMING_ROUNDS and (mode, k) != ("sequential", 8)
  hist = np.zeros(9, np.int64)
  hist[k] = 8  # every draft verified is accepted
  # chunks far off the timed cost, but fewer than RETIME_STEPS, change nothing ...
  d.observe(hist, mode, k, B=1, steps=8, seconds=8 * 0.6 * d.cost_model._cost(mode, k))
  assert not d.cost_model.timing_was_off(1)
  d.choose(state, 1, 8, B=1, S=64)
  assert len(timings) == 3 * flex_costs.TIMING_ROUNDS
  # ... over RETIME_STEPS steps the steps are timed again
  d.observe(hist, mode, k, B=1, steps=8, seconds=8 * 0.6 * d.cost_model._cost(mode, k))
  assert d.cost_model.timing_was_off(1)
  assert d.choose(state, 1, 8, B=1, S=64) == ("sequential", 8)
  assert len(timings) == 6 * flex_costs.TIMING_ROUNDS
  assert d.cost_model.costs["sequential"]["8"] == real[("sequential", 8)]
  assert d.cost_model.realized.get(1) is None and not d.cost_model.timing_was_off(1)
  # once per batch shape
  d.observe(hist, "sequential", 8, B=1, steps=16, seconds=16 * 3.0)
  d.choose(state, 1, 8, B=1, S=64)
  assert len(timings) == 6 * flex_costs.TIMING_ROUNDS


def test_flex_corrects_each_verify_length_by_its_own_chunks():
  # k = 8's timed cost read 20 % high (a slow spell while it was timed), k = 4's
  # right: each length's chunks correct its own cost once it has MIN_TIMED
  # steps, and the mode's other lengths share the mode's ratio.
  d = _driver()
  d.cost_model.modes = ("sequential",)
  d.cost_model.costs = {"ar": 1.0, "sequential": {"2": 1.5, "3": 1.55, "4": 1.6, "8": 1.8}}
  hist = np.zeros(9, np.int64)
  hist[1] = 16
  d.observe(hist, "sequential", 8, B=1, steps=16, seconds=16 * 1.5)
  d.observe(hist, "sequential", 4, B=1, steps=16, seconds=16 * 1.6)
  assert d.cost_model.cost_scale(1, "sequential", 8) == pytest.approx(1.5 / 1.8)
  assert d.cost_model.cost_scale(1, "sequential", 4) == pytest.approx(1.0)
  pooled = (16 * 1.5 + 16 * 1.6) / (16 * 1.8 + 16 * 1.6)
  assert d.cost_model.cost_scale(1, "sequential", 2) == pytest.approx(pooled)
  assert d.cost_model.cost_scale(1, "sequential") == pytest.approx(pooled)
  # the prediction uses them: τ(8) ≥ τ(4), so k = 8 at its realized 1.5 beats
  # k = 4 at 1.6 (on the timed costs it would lose wherever τ(8) < 1.125 τ(4))
  rates = d.predicted_rates(_conf_state([0.9] * 7), B=1)
  tau = d.tau_by_length(_conf_state([0.9] * 7))
  assert rates[("sequential", 8)] == pytest.approx(tau[8] / 1.5)
  assert rates[("sequential", 8)] > rates[("sequential", 4)]


def test_flex_modes_that_have_not_run_share_the_machine_s_slowdown(monkeypatch):
  # Every mode's chunks run 20 % over the timed costs on a busy machine: AR,
  # not run since, is assumed 20 % slower too (up to MACHINE_DRIFT) ...
  d = _driver(verify_len=2)
  d.cost_model.modes = ("sequential",)
  d.cost_model.costs = {"ar": 1.0, "sequential": {"2": 1.0}}
  state = _conf_state([0.1] + [0.5] * 6)  # τ(2) = 1.1 at AR's cost
  # (its acceptance counts left out: τ stays the confidences')
  d.observe(np.zeros(9), "sequential", 2, B=1, steps=16, seconds=16 * 1.2)
  assert d.cost_model.cost_scale(1, "ar") == pytest.approx(1.2)
  # ... but where speculation wins only so (1.1 / 1.2 against AR's 1 / 1.0),
  # the slowdown may be the mode's own: MIN_TIMED AR steps time AR first.
  assert d.choose(state, 1, 2, B=1, S=64) == ("ar", 0)
  assert d.stats()["flex_choices"]["1"]["timing_ar"]
  assert d.chunk_steps(1, "ar", 0, default=64) == flex_costs.MIN_TIMED
  assert not d.sticky_ar("sequential")
  d.observe(np.zeros(9), "ar", 0, B=1, steps=flex_costs.MIN_TIMED,
            seconds=flex_costs.MIN_TIMED * 1.0)
  assert not d.sticky_ar("ar")  # the choice is made again once AR is timed
  # AR ran as timed: the slowdown was speculation's own
  assert d.choose(state, 1, 2, B=1, S=64) == ("ar", 0)
  assert not d.stats()["flex_choices"]["1"]["timing_ar"]
  # AR ran 20 % slow as well: the machine's, and speculation wins
  d.cost_model.realized[1].pop(("ar", 0))
  d.observe(np.zeros(9), "ar", 0, B=1, steps=flex_costs.MIN_TIMED,
            seconds=flex_costs.MIN_TIMED * 1.2)
  assert d.cost_model.cost_scale(1, "ar") == pytest.approx(1.2)
  monkeypatch.setattr(flex, "AR_MARGIN", 1.0)  # (1.1 / 1.2 vs 1 / 1.2: within 1.05)
  assert d.choose(state, 1, 2, B=1, S=64) == ("sequential", 2)


def test_flex_reports_its_predictions_against_its_chunks():
  d = _driver(verify_len=2)
  d.cost_model.modes = ("sequential",)
  d.cost_model.costs = {"ar": 1.0, "sequential": {"2": 1.0}}
  state = _conf_state([[0.5] + [0.5] * 6] * 2)  # τ(2) = 1.5
  assert d.choose(state, 2, 2, B=2, S=64) == ("sequential", 2)
  hist = np.zeros(9, np.int64)
  hist[1] = 16  # 16 row-steps, nothing accepted: 1 token a row-step
  d.observe(hist, "sequential", 2, B=2, steps=8, seconds=8 * 1.0)
  why = d.stats()["flex_choices"]["2"]
  # predicted 2 rows x 1.5 tokens a second; measured 16 tokens in 8 s
  assert why["chunks"] == {"sequential:2": {"steps": 8, "predicted_tokens_per_s": 3.0,
                                            "measured_tokens_per_s": 2.0,
                                            "tokens": 16, "seconds": 8.0}}
  assert why["run_predicted_over_ar"] == {"sequential:2": 1.5}


def test_generate_sums_flex_s_chunks_over_the_batches_of_one_shape():
  part = lambda chunks: {
      "prefill_seconds": 0.0, "decode_seconds": 1.0, "compile_seconds": 0.0,
      "flex_timing_seconds": 0.0, "new_tokens": 0, "decode_tokens": 0, "steps": 0,
      "committed_tokens": 0, "verified_row_steps": 0, "accept_hist": [0],
      "draft_dtype": None, "flex_threshold": "auto", "step_costs": {},
      "flex_choices": {"1": {"choice": ["ar", 0], "chunks": chunks}}}
  first = part({"sequential:4": flex_costs.chunk_record(8, 30.0, 96, 4.0)})
  second = part({"sequential:4": flex_costs.chunk_record(24, 50.0, 120, 2.0),
                 "ar": flex_costs.chunk_record(8, 20.0, 8, 0.5)})
  merged = call_stats.merge_stats([first, second], "flex")["flex_choices"]["1"]["chunks"]
  # 32 steps: predicted (8·30 + 24·50) / 32 = 45; measured 216 tokens in 6 s
  assert merged["sequential:4"] == flex_costs.chunk_record(32, 45.0, 216, 6.0)
  assert merged["sequential:4"]["measured_tokens_per_s"] == 36.0
  assert merged["ar"] == flex_costs.chunk_record(8, 20.0, 8, 0.5)
  # the parts' own records are left as they were
  assert first["flex_choices"]["1"]["chunks"]["sequential:4"]["steps"] == 8


def test_flex_needs_a_margin_over_ar():
  d = _driver(verify_len=2)
  d.cost_model.modes = ("sequential",)
  d.cost_model.costs = {"ar": 1.0, "sequential": {"2": 1.0}}
  # τ(2) = 1 + slot 1's confidence: just under the margin, then just over it
  state = _conf_state([flex.AR_MARGIN - 1.01] + [0.5] * 6)
  assert d.choose(state, 1, 2, B=1, S=64) == ("ar", 0)
  state = _conf_state([flex.AR_MARGIN - 0.99] + [0.5] * 6)
  assert d.choose(state, 1, 2, B=1, S=64) == ("sequential", 2)


def test_flex_keeps_speculating_while_it_is_predicted_as_fast_as_ar():
  # Hysteresis: AR_MARGIN to start speculating, STAY_MARGIN to go on.
  d = _driver(verify_len=2)
  d.cost_model.modes = ("sequential",)
  d.cost_model.costs = {"ar": 1.0, "sequential": {"2": 1.0}}
  between = _conf_state([(flex.STAY_MARGIN + flex.AR_MARGIN) / 2 - 1] + [0.5] * 6)
  assert d.choose(between, 1, 2, B=1, S=64) == ("ar", 0)  # from AR: not enough
  d.observe(np.zeros(9), "sequential", 2, B=1, steps=0)
  assert d.choose(between, 1, 2, B=1, S=64) == ("sequential", 2)  # speculating: stays
  d.cost_model.costs["sequential"]["2"] = 1.1  # now slower than AR: back to AR
  assert d.choose(between, 1, 2, B=1, S=64) == ("ar", 0)


def test_flex_falls_back_to_ar_when_speculation_is_slower_than_timed(
    target, cost_cache, monkeypatch):
  def measure(self, state, B, S, again=False):  # sequential "timed" at half of AR
    cost = {"sequential": 0.5e-6, "parallel": 100.0}  # a real step takes ~1 ms
    return {"ar": 1e-6, **{m: {str(k): cost[m] for k in self.buckets} for m in self.modes}}
  monkeypatch.setattr(flex_costs.StepCosts, "measure", measure)
  prompts = prompts_for(1, seed=11)
  drafter = random_drafter(target, block_size=4, noise=0.5)
  ref = fd.generate(target, prompts, max_new_tokens=80)
  # one bucket; a cache length no other test uses, so the first chunk compiles
  kw = dict(max_new_tokens=80, drafter=drafter, mode="flex",
            speculation=fd.SpecOptions(verify_len=2), runtime=fd.RuntimeOptions(max_len=448))
  for probe_chunks in (3, 2):
    out = fd.generate(target, prompts, **kw)
    assert_lossless(target, prompts, ref.token_ids, out.token_ids)
    # short probe chunks of speculation until MIN_TIMED steps ran without
    # compiling (the first chunk of the cold run compiles), then AR to the
    # end: the real steps cost far more than 1 µs.
    assert [m for m, _ in out.stats["mode_steps"]] == ["sequential", "ar"]
    assert out.stats["mode_steps"][0][1] == probe_chunks * flex.PROBE_STEPS
    (why,) = out.stats["flex_choices"].values()
    assert why["choice"] == ["ar", 0] and why["cost_scale"]["sequential"] > 100


def test_step_cost_key_names_the_cost_model_version_and_the_draft_pass(monkeypatch):
  # costs timed before a change to the decode step are not reused after it
  c = _driver().cost_model
  c.target = types.SimpleNamespace(fingerprint="fp")
  c.drafter.config.num_layers, c.drafter.config.draft_vocab = 4, 0
  c.drafter.params = {}
  now = c.cost_key(1, 256)
  assert now == c.cost_key(1, 256) and now != c.cost_key(4, 256)
  # a draft pass in bf16 costs less: its own entry
  c.drafter.params = {"deep_mlp": [{"gate_t": jnp.zeros((2, 2), jnp.bfloat16)}]}
  assert c.cost_key(1, 256) != now
  c.drafter.params = {}
  # so does a draft pass that re-scores slot by slot (the n-gram prior)
  c.drafter.config.rescores, c.drafter.config.rescore_top = True, 32
  assert c.cost_key(1, 256) != now
  c.drafter.config.rescores = False
  monkeypatch.setattr(flex_costs, "STEP_COST_VERSION", flex_costs.STEP_COST_VERSION - 1)
  assert c.cost_key(1, 256) != now


def test_step_cost_cache_location_and_failures(target, tmp_path, monkeypatch):
  monkeypatch.delenv("FLEXDRAFT_COST_CACHE", raising=False)
  # the other caches under $XDG_CACHE_HOME stay where they are (run alone, this
  # test would otherwise build the CPU kernel and keep programs in tmp_path/xdg)
  from flexdraft_jax.kernels import cpu_matmul
  monkeypatch.setenv("FLEXDRAFT_KERNEL_CACHE", cpu_matmul.cache_dir())
  monkeypatch.setenv("FLEXDRAFT_COMPILE_CACHE", "off")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert step_costs.cost_cache_path() == str(tmp_path / "xdg" / "flexdraft_jax" / "step_costs.json")
  assert step_costs.cost_cache_path(None) is None
  monkeypatch.setattr(step_costs, "_COSTS_IN_MEMORY", {})
  prompts = prompts_for(2, seed=9)
  drafter = random_drafter(target, block_size=4, noise=0.5)
  ref = fd.generate(target, prompts, max_new_tokens=12)
  run = lambda cache: fd.generate(target, prompts, max_new_tokens=12, drafter=drafter,
                                  mode="flex", speculation=fd.SpecOptions(cost_cache=cache))
  # unwritable (its parent is a file): warns, keeps the costs in memory, output intact
  (tmp_path / "afile").write_text("x")
  with pytest.warns(RuntimeWarning, match="cannot write the step-cost cache"):
    out = run(str(tmp_path / "afile" / "costs.json"))
  assert out.token_ids == ref.token_ids and out.stats["step_costs"]
  # not ours (broken JSON, another shape, a folder): warns, keeps the costs in
  # memory and leaves the file as it is; nothing stray beside it
  for name, text in (("bad.json", "{not json"), ("list.json", "[1, 2, 3]")):
    bad = tmp_path / name
    bad.write_text(text)
    with pytest.warns(RuntimeWarning, match="is not a step-cost cache this can read"):
      out = run(str(bad))
    assert out.token_ids == ref.token_ids and bad.read_text() == text
  (tmp_path / "adir").mkdir()
  with pytest.warns(RuntimeWarning, match="is not a step-cost cache this can read"):
    assert run(str(tmp_path / "adir")).token_ids == ref.token_ids
  # read-only (a table of another shape's costs): read, measured, not replaced
  ro = tmp_path / "ro.json"
  ro.write_text(json.dumps({"another shape": {"ar": 0.5}}))
  ro.chmod(0o444)
  before = ro.read_text()
  with pytest.warns(RuntimeWarning, match="cannot write the step-cost cache"):
    out = run(str(ro))
  assert out.token_ids == ref.token_ids and ro.read_text() == before
  assert "another shape" in step_costs._COSTS_IN_MEMORY[str(ro)]
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "adir", "afile", "bad.json", "list.json", "ro.json"]
  # memory only: nothing written anywhere
  out = run(None)
  assert out.token_ids == ref.token_ids and not (tmp_path / "xdg").exists()


def test_two_writers_of_one_cost_cache_merge_and_keep_its_mode(tmp_path, monkeypatch):
  import subprocess
  import sys
  path = str(tmp_path / "costs.json")
  monkeypatch.setattr(step_costs, "_COSTS_IN_MEMORY", {})
  # a run reads the table at its start; another writes meanwhile; the first
  # then writes what it measured: both measurements stay
  with open(path, "w") as f:
    json.dump({"old": {"ar": 1.0}}, f)
  os.chmod(path, 0o640)
  assert step_costs.read_costs(path) == {"old": {"ar": 1.0}}
  with open(path, "w") as f:  # the other run's write
    json.dump({"old": {"ar": 1.0}, "theirs": {"ar": 2.0}}, f)
  step_costs.write_costs(path, {"mine": {"ar": 3.0}})
  with open(path) as f:
    assert json.load(f) == {"old": {"ar": 1.0}, "theirs": {"ar": 2.0}, "mine": {"ar": 3.0}}
  assert os.stat(path).st_mode & 0o777 == 0o640  # was 0600 after a write
  assert step_costs._COSTS_IN_MEMORY[path]["theirs"] == {"ar": 2.0}
  # two processes writing at once, 40 measurements each: none lost
  code = ("import sys; from flexdraft_jax.decoding import step_costs as s\n"
          "for i in range(40):\n"
          "  s.write_costs(sys.argv[1], {f'{sys.argv[2]}{i}': {'ar': float(i)}})")
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
  procs = [subprocess.Popen([sys.executable, "-c", code, path, who], env=env)
           for who in ("a", "b")]
  assert [p.wait(timeout=120) for p in procs] == [0, 0]
  with open(path) as f:
    table = json.load(f)
  assert sorted(table) == sorted(["old", "theirs", "mine"] + [f"{w}{i}" for w in "ab"
                                                             for i in range(40)])
  assert os.stat(path).st_mode & 0o777 == 0o640
  assert sorted(os.listdir(tmp_path)) == ["costs.json", "costs.json.lock"]  # no .tmp left


def test_compile_time_is_the_union_of_overlapping_spans():
  from flexdraft_jax.decoding import timing
  spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.7)]  # nested and overlapping
  assert timing.covered(spans, 0.5, 5.8) == pytest.approx(2.5 + 0.8)
  assert timing.covered(spans, 3.0, 5.0) == 0.0


def test_tokens_per_second_leaves_out_compiling_and_flex_step_timing(target, monkeypatch):
  import time
  monkeypatch.setattr(step_costs, "_COSTS_IN_MEMORY", {})
  # Flex times its steps, then runs AR: a choice that cannot hinge on how long
  # the chunks took, so the warm run has nothing left to compile.
  monkeypatch.setattr(flex, "AR_MARGIN", 1e9)
  drafter = random_drafter(target, block_size=4, noise=0.5)
  prompts = prompts_for(2, seed=11)
  # a cache length no other test uses: the first call compiles its steps
  kw = dict(max_new_tokens=40, drafter=drafter, mode="flex",
            speculation=fd.SpecOptions(cost_cache=None), runtime=fd.RuntimeOptions(max_len=704))
  t = time.perf_counter()
  cold = fd.generate(target, prompts, **kw).stats
  wall = time.perf_counter() - t
  assert cold["compile_seconds"] > 0 and cold["flex_timing_seconds"] > 0
  assert cold["decode_seconds"] <= wall - cold["flex_timing_seconds"] - cold["prefill_seconds"]
  warm = fd.generate(target, prompts, **kw).stats  # nothing left to compile or time
  assert warm["compile_seconds"] == 0 and warm["flex_timing_seconds"] == 0
  assert cold["decode_tokens"] == warm["decode_tokens"]
  # Compiling and timing the steps took many times the decode itself, and the
  # cold run's decode time exceeds the warm one's by a small part of them: had
  # either been counted, the excess would be at least its size. (A ratio of the
  # two rates would measure the machine's load: the decode is milliseconds.)
  spent = cold["compile_seconds"] + cold["flex_timing_seconds"]
  assert spent > 3 * cold["decode_seconds"]
  assert cold["decode_seconds"] - warm["decode_seconds"] < 0.1 * min(
      cold["compile_seconds"], cold["flex_timing_seconds"])


def bonus_drafter(target, block_size=4):
  """A random drafter that reads the bonus at slot 0 (a large `bonus_in`)."""
  import dataclasses
  d = random_drafter(target, block_size=block_size, noise=0.5)
  H = target.config.hidden_size
  dcfg = dataclasses.replace(d.config, bonus_input=True)
  w = 3.0 * jax.random.normal(jax.random.PRNGKey(5), (H, H)) / np.sqrt(H)
  return d._replace(config=dcfg, params=dict(d.params, bonus_in=w))


def test_a_drafter_reading_the_bonus_decodes_losslessly_without_parallel(
    target, cost_cache, monkeypatch):
  prompts = prompts_for(3, seed=9)
  drafter = bonus_drafter(target)
  ref = fd.generate(target, prompts, max_new_tokens=30)
  timed = []
  real = driver.Driver._time
  monkeypatch.setattr(driver.Driver, "_time",
                      lambda self, *a, **kw: timed.append(a[1]) or real(self, *a, **kw))
  runs = [("sequential", {}), ("sequential", dict(threshold=0.3)),
          ("sequential", dict(verify_len=2)), ("flex", {}), ("flex", dict(flex_threshold=8))]
  for mode, spec in runs:
    out = fd.generate(target, prompts, max_new_tokens=30, drafter=drafter, mode=mode,
                      speculation=fd.SpecOptions(**spec))
    assert_lossless(target, prompts, ref.token_ids, out.token_ids)
    assert "parallel" not in {m for m, _ in out.stats["mode_steps"]}
  assert "parallel" not in timed and "sequential" in timed   # flex never considers it
  # parallel mode drafts it blind (lossless, with a warning that it was not trained so)
  with pytest.warns(fd.FlexDraftWarning, match="without bonus_dropout"):
    out = fd.generate(target, prompts, max_new_tokens=30, drafter=drafter, mode="parallel")
  assert_lossless(target, prompts, ref.token_ids, out.token_ids)
  # prefill's drafts come after t0 and read it: without it (bonus_in = 0) they differ
  from flexdraft_jax.decoding import state as state_lib
  from flexdraft_jax.decoding.sampling import SamplingParams
  plain = drafter._replace(params=dict(drafter.params,
                                       bonus_in=0 * drafter.params["bonus_in"]))

  def first_drafts(d):
    cfg = target.config
    cache = pytree.KVCache.zeros(cfg, 1, 32, jnp.float32)
    st = state_lib.prefill(target.params, cfg, cache, jnp.array([[5, 9, 12, 7]]),
                           jnp.array([4]), jnp.array([True]), jax.random.PRNGKey(0),
                           sp=SamplingParams(), max_new=8, out_len=8, stop_ids=jnp.array([-1]),
                           drafter=d)
    return np.asarray(st.drafts_BxD)

  assert not np.array_equal(first_drafts(drafter), first_drafts(plain))


def test_two_drafters_one_for_each_mode(target, cost_cache, monkeypatch):
  # generate(parallel_drafter=P): parallel steps draft with P (trained blind),
  # sequential steps with the drafter that reads the bonus; flex weighs both,
  # and the drafts in flight pass between them losslessly.
  import dataclasses
  import warnings
  prompts = prompts_for(3, seed=6)
  reading = bonus_drafter(target)
  blind = random_drafter(target, block_size=4, seed=3, noise=0.5)
  blind = blind._replace(config=dataclasses.replace(blind.config, bonus_input=True,
                                                    bonus_dropout=1.0))
  blind = blind._replace(params=dict(blind.params, bonus_in=reading.params["bonus_in"]))
  assert blind.config.drafts_blind and not reading.config.drafts_blind
  ref = fd.generate(target, prompts, max_new_tokens=30)
  used = []  # (mode, the draft params' mask vector) of every chunk
  real_chunk = chunk.run_chunk
  monkeypatch.setattr(chunk, "run_chunk", lambda tp, dp, st, **kw: used.append(
      (str(kw["mode"]), None if dp is None else float(np.asarray(dp["mask"]).sum())))
      or real_chunk(tp, dp, st, **kw))
  mark = {float(np.asarray(reading.params["mask"]).sum()): "reading",
          float(np.asarray(blind.params["mask"]).sum()): "blind"}
  assert len(mark) == 2
  with warnings.catch_warnings():
    warnings.simplefilter("error", fd.FlexDraftWarning)
    for mode, spec in (("flex", {}), ("flex", dict(flex_threshold=8)),
                       ("flex", dict(flex_threshold=0)), ("parallel", {})):
      used.clear()
      out = fd.generate(target, prompts, max_new_tokens=30, drafter=reading,
                        parallel_drafter=blind, mode=mode,
                        speculation=fd.SpecOptions(**spec))
      assert_lossless(target, prompts, ref.token_ids, out.token_ids)
      ran = {(m, mark[x]) for m, x in used if m != "ar"}
      # each mode with its own drafter, and only with it
      assert ran <= {("parallel", "blind"), ("sequential", "reading")}, (mode, spec, ran)
      want = {"flex": {m for m in ("parallel", "sequential")
                       if (spec.get("flex_threshold") == 8) == (m == "parallel")},
              "parallel": {"parallel"}}[mode]
      if spec or mode == "parallel":  # B* given: it says which mode runs
        assert {m for m, _ in ran} == want, (mode, spec, ran)
  # flex with B* = "auto" times (and so weighs) both modes
  timed = []
  real = driver.Driver._time
  monkeypatch.setattr(driver.Driver, "_time",
                      lambda self, *a, **kw: timed.append(a[1]) or real(self, *a, **kw))
  out = fd.generate(target, prompts, max_new_tokens=30, drafter=reading,
                    parallel_drafter=blind, mode="flex",
                    speculation=fd.SpecOptions(cost_cache=""))
  assert_lossless(target, prompts, ref.token_ids, out.token_ids)
  assert "parallel" in timed and "sequential" in timed
  # sampled drafts (T > 0) hand their draft distributions over too: the run
  # completes, every row within its budget
  out = fd.generate(target, prompts, max_new_tokens=12, drafter=reading,
                    parallel_drafter=blind, mode="flex",
                    sampling=fd.SamplingParams(temperature=1.0, draft_sampling=True),
                    speculation=fd.SpecOptions(flex_threshold=2))
  assert all(0 < len(t) <= 12 for t in out.token_ids)
  # sequential mode has no use for it, and says so
  with pytest.warns(fd.FlexDraftWarning, match="does not use the parallel drafter"):
    fd.generate(target, prompts, max_new_tokens=4, drafter=reading,
                parallel_drafter=blind, mode="sequential")


def test_two_drafters_must_share_block_size_and_draft_vocabulary(target):
  reading = bonus_drafter(target)
  other_block = random_drafter(target, block_size=2, seed=3)
  with pytest.raises(fd.FlexDraftError, match="block size 2 differs from the drafter's 4"):
    fd.generate(target, [[1, 2, 3]], max_new_tokens=4, drafter=reading,
                parallel_drafter=other_block, mode="flex")
  ids = np.arange(0, target.config.vocab_size, 2)
  narrow = vocab_drafter(random_drafter(target, block_size=4, seed=3), ids)
  with pytest.raises(fd.FlexDraftError, match="draft vocabulary differs"):
    fd.generate(target, [[1, 2, 3]], max_new_tokens=4, drafter=reading,
                parallel_drafter=narrow, mode="flex")
  # a parallel drafter that reads the bonus would draft blind, poorly: a warning
  with pytest.warns(fd.FlexDraftWarning, match="parallel drafter was trained to read"):
    fd.generate(target, [[1, 2, 3]], max_new_tokens=4, drafter=reading,
                parallel_drafter=bonus_drafter(target), mode="flex",
                speculation=fd.SpecOptions(flex_threshold=8))


def test_a_drafter_trained_blind_too_runs_every_mode(target, cost_cache, monkeypatch):
  # bonus_dropout > 0: the same weights draft blind inside the verify forward
  # (parallel mode: slot 0 is the mask alone) and with the bonus after it
  # (sequential); flex weighs both.
  import dataclasses
  import warnings
  from flexdraft_jax.decoding import state as state_lib
  prompts = prompts_for(3, seed=4)
  reading = bonus_drafter(target)
  drafter = reading._replace(config=dataclasses.replace(reading.config, bonus_dropout=0.5))
  assert drafter.config.drafts_blind and not reading.config.drafts_blind
  ref = fd.generate(target, prompts, max_new_tokens=30)
  timed = []
  real = driver.Driver._time
  monkeypatch.setattr(driver.Driver, "_time",
                      lambda self, *a, **kw: timed.append(a[1]) or real(self, *a, **kw))
  with warnings.catch_warnings():
    warnings.simplefilter("error", fd.FlexDraftWarning)
    for mode, theta in (("parallel", 0.0), ("parallel", 0.2), ("sequential", 0.0),
                        ("flex", 0.0)):
      out = fd.generate(target, prompts, max_new_tokens=30, drafter=drafter, mode=mode,
                        speculation=fd.SpecOptions(threshold=theta))
      assert_lossless(target, prompts, ref.token_ids, out.token_ids)
  assert "parallel" in timed and "sequential" in timed
  # the parallel step's drafting groups read no bonus: the same as bonus_in = 0
  masks = state_lib.mask_block(jnp.array([6]), jnp.array([5]), 2, 4)
  cfg = target.config
  blind = transformer.mask_input(target.params, cfg, drafter.params, masks, jnp.float32)
  plain = transformer.mask_input(
      target.params, cfg, dict(drafter.params, bonus_in=0 * drafter.params["bonus_in"]),
      masks, jnp.float32)
  np.testing.assert_array_equal(blind, plain)


def test_tau_counts_emitted_tokens_only_overall_and_per_mode(target, cost_cache):
  # A step that accepts past max_new_tokens commits tokens that are never
  # emitted: τ leaves them out (committed_tokens keeps them, for diagnosis).
  tgt = tiny_target(vocab=16, eos=0, scale=0.5, seed=4)
  prompts = [[t % 16 for t in p] for p in prompts_for(4, seed=3)]
  drafter = bigram_drafter(tgt, block_size=4)
  over = 0
  for max_new in (5, 6, 7, 9):
    out = fd.generate(tgt, prompts, max_new_tokens=max_new, stop=[], drafter=drafter,
                      mode="sequential")
    s = out.stats
    assert s["decode_tokens"] == sum(len(t) for t in out.token_ids) - len(prompts)
    assert s["tau"] == pytest.approx(s["decode_tokens"] / s["verified_row_steps"])
    assert s["committed_tokens"] >= s["decode_tokens"]
    over += s["committed_tokens"] > s["decode_tokens"]
    assert s["mode_tau"] == {"sequential": pytest.approx(s["tau"])}
  assert over                            # some step committed past the end
  out = fd.generate(tgt, prompts, max_new_tokens=24, stop=[], drafter=drafter, mode="flex",
                    speculation=fd.SpecOptions(flex_threshold=2))
  emitted = out.stats["mode_emitted"]
  assert sum(t for _, t in emitted.values()) == out.stats["decode_tokens"]
  assert sum(r for r, _ in emitted.values()) == out.stats["verified_row_steps"]
  assert set(out.stats["mode_tau"]) == set(emitted)


def test_a_call_s_batches_share_one_prompt_width(target, monkeypatch):
  # Each prompt shape is a prefill program to compile or load: the batches of
  # one call pad their prompts to the call's longest, and decode as before.
  from flexdraft_jax.decoding import engine
  widths, real = [], engine.prefill_batch

  def spy(target_params, draft_params, prompt_BxP, *a, **kw):
    widths.append(prompt_BxP.shape[1])
    return real(target_params, draft_params, prompt_BxP, *a, **kw)

  prompts = [[5, 6, 7], [3 + i % 50 for i in range(70)], [9, 10]]
  alone = [fd.generate(target, [p], max_new_tokens=6, stop=[]).token_ids[0] for p in prompts]
  monkeypatch.setattr(engine, "prefill_batch", spy)
  out = fd.generate(target, prompts, max_new_tokens=6, stop=[],
                    runtime=fd.RuntimeOptions(batch_size=1))
  assert widths == [128, 128, 128]  # 70 tokens padded to a multiple of 64
  assert out.token_ids == alone
