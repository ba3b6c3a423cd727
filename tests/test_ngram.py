"""The n-gram prior: tables, the bias, slot-by-slot drafting, lossless decoding."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flexdraft_jax as fd
from flexdraft_jax.decoding import ar, sequential
from flexdraft_jax.decoding import state as state_lib
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.drafter import checkpoint, ngram
from flexdraft_jax.drafter.model import (Drafter, DrafterConfig, draft_logits,
                                         init_draft_params, rescored_drafts, trainable)
from flexdraft_jax.model import pytree
from tests.decoding_util import ngram_drafter, random_drafter, tiny_target
from tests.test_decoding import assert_lossless, prompts_for


@pytest.fixture(scope="module")
def target():
  return tiny_target(vocab=16, eos=0, scale=0.5, seed=4)


def _prompts(n=4, seed=3):
  return [[t % 16 for t in p] for p in prompts_for(n, seed=seed)]


def test_tables_and_pmi_are_the_smoothed_counts():
  answers = [[1, 2, 3, 4, 3, 4, 5], [2, 3, 4, 9]]
  vocab = np.array([3, 4, 5, 2, 1])            # 9 is outside: index 5 = K
  t = ngram.build_tables(answers, vocab, 10)
  K = 5
  assert t["index"].tolist() == [5, 4, 3, 0, 1, 2, 5, 5, 5, 5]
  # answer tokens after the first two: 3 4 3 4 5 | 4 (9 is not counted)
  uni = np.bincount([0, 1, 0, 1, 2, 1], minlength=K) + 1.0
  np.testing.assert_allclose(np.exp(t["uni_logp"]), uni / uni.sum(), rtol=1e-6)
  assert t["prev_count"].tolist() == [3, 2, 0, 1, 0, 0]     # prevs: 2 3 4 3 4 | 3
  ng = jax.tree.map(jnp.asarray, t)
  # p(4 | 2, 3): trigram (2, 3) -> 4 seen twice, context (2, 3) twice
  pu = uni / uni.sum()
  p_bi = (3 + 1.0 * pu[1]) / (3 + 1.0)                   # 3 -> 4 three times of 3
  p_tri = (2 + 2.0 * p_bi) / (2 + 2.0)
  got = ngram.data_pmi(ng, K, jnp.array([2]), jnp.array([3]), jnp.array([[1]]), 1.0, 2.0)
  np.testing.assert_allclose(float(got[0, 0]), math.log(p_tri) - math.log(pu[1]), rtol=1e-5)
  # prev2 = -1: the bigram alone; an unseen context backs off to the bigram
  got = ngram.data_pmi(ng, K, jnp.array([-1, 5]), jnp.array([3, 3]), jnp.array([[1], [1]]),
                       1.0, 2.0)
  np.testing.assert_allclose(np.asarray(got[:, 0]), [math.log(p_bi / pu[1])] * 2, rtol=1e-5)


def test_in_context_finds_the_row_s_ngrams_up_to_the_bonus():
  hist = jnp.array([[7, 1, 2, 3, 1, 2, 9, -1]])
  # up to position 5 (…1 2): "1 2" -> 3 occurs; "2 9" only at position 6
  tri, bi = ngram.in_context(hist, jnp.array([[5, 5, 6]]), jnp.array([[1, -1, 1]]),
                             jnp.array([[2, 2, 2]]), jnp.array([[[3, 9]] * 3][0])[None])
  assert tri.tolist() == [[[1, 0], [0, 0], [1, 1]]]   # "1 2 9" ends at 6
  assert bi.tolist() == [[[1, 0], [1, 0], [1, 1]]]


def test_rescored_drafting_is_what_training_scores_with_the_true_tokens(target):
  """Drafting re-scores slot j given the drafts before it; training feeds the
  true tokens there. With the drafts as the truth both give the same logits."""
  d = ngram_drafter(target, block_size=5, top=6)
  cfg, H = target.config, target.config.hidden_size
  h = jax.random.normal(jax.random.PRNGKey(0), (3, 4, H))
  bonus = jnp.array([3, 7, 11])
  hist = jnp.asarray(np.random.RandomState(0).randint(0, 16, size=(3, 20)))
  hist = hist.at[:, 12].set(bonus)
  upto = jnp.array([12, 12, 12])
  plain = draft_logits(target.params, cfg, d, h, jnp.broadcast_to(bonus[:, None], (3, 4)))
  rescored, picks = rescored_drafts(cfg, d, plain, bonus, hist, upto,
                                    lambda j, lg: jnp.argmax(lg, -1))
  prev = jnp.concatenate([bonus[:, None], picks[:, :-1]], 1)
  prev2 = jnp.concatenate([jnp.full((3, 1), -1), prev[:, :-1]], 1)
  forced = draft_logits(target.params, cfg, d, h, jnp.broadcast_to(bonus[:, None], (3, 4)),
                        context=(prev2, prev, hist, jnp.broadcast_to(upto[:, None], (3, 4))))
  np.testing.assert_allclose(np.asarray(rescored), np.asarray(forced), rtol=1e-5, atol=1e-5)
  assert np.array_equal(np.asarray(picks), np.asarray(jnp.argmax(forced, -1)))
  moved = np.asarray(forced != plain)
  assert moved.any() and moved.sum(-1).max() <= 6   # only each row's 6 largest move
  top6 = np.argsort(-np.asarray(plain), -1)[..., :6]
  assert all(set(np.flatnonzero(moved[b, s])) <= set(top6[b, s])
             for b in range(3) for s in range(4))


@pytest.mark.parametrize("mode, spec", [("sequential", {}), ("parallel", {}),
                                        ("sequential", dict(threshold=0.3)),
                                        ("sequential", dict(verify_len=2)),
                                        ("flex", dict(flex_threshold=1))])
def test_a_drafter_with_the_prior_is_lossless(target, mode, spec):
  d = ngram_drafter(target)
  prompts = _prompts()
  ref = fd.generate(target, prompts, max_new_tokens=24, stop=[])
  kw = dict(mode=mode, speculation=fd.SpecOptions(**spec))
  out = fd.generate(target, prompts, max_new_tokens=24, stop=[], drafter=d, **kw)
  assert_lossless(target, prompts, ref.token_ids, out.token_ids)
  off = d._replace(config=dataclasses.replace(d.config, ngram_weight=0.0, context_trigram=0.0,
                                               context_bigram=0.0))
  plain = fd.generate(target, prompts, max_new_tokens=24, stop=[], drafter=off, **kw)
  # the prior knows the target's habits: more drafts accepted than without it
  assert out.stats["tau"] > plain.stats["tau"], (out.stats["tau"], plain.stats["tau"])


def test_decoding_keeps_each_row_s_text_and_drafts_from_it(target):
  """The state's `hist` is the prompt and every decided token (through
  speculative and AR steps); with a large row-text weight the drafts copy
  what followed the bonus in the row's text (prompt lookup)."""
  d = ngram_drafter(target, weight=0.0, context=(50.0, 40.0))
  cfg, sp = target.config, SamplingParams()
  prompt = jnp.array([[5, 9, 12, 7, 3], [2, 3, 4, 1, 0]])
  plen = jnp.array([5, 4])
  st = state_lib.prefill(target.params, cfg, pytree.KVCache.zeros(cfg, 2, 64, jnp.float32),
                         prompt, plen, jnp.array([True, True]), jax.random.PRNGKey(0), sp=sp,
                         max_new=20, out_len=20, stop_ids=jnp.array([-1]), drafter=d)
  stop = jnp.array([-1])
  for step in ("seq", "ar", "seq", "seq", "ar"):
    if step == "seq":
      st = sequential.sequential_step(target.params, cfg, d, st, sp=sp, max_new=20,
                                      stop_ids=stop)
    else:
      st = ar.ar_step(target.params, cfg, st, sp=sp, max_new=20, stop_ids=stop)
  hist, out, n = np.asarray(st.hist_BxL), np.asarray(st.out_BxO), np.asarray(st.n_out_B)
  for b in range(2):
    p = int(plen[b])
    text = np.asarray(prompt[b, :p]).tolist() + out[b, :n[b]].tolist()
    assert hist[b, :len(text)].tolist() == text
    assert (hist[b, len(text):] == -1).all()
    assert int(st.length_B[b]) == len(text) - 1   # the bonus is the last of them
  # drafts: what followed the bonus earlier in the row's text (the row-text
  # weights dominate the random drafter's logits)
  st = state_lib.prefill(target.params, cfg, pytree.KVCache.zeros(cfg, 1, 64, jnp.float32),
                         jnp.array([[1, 4, 7] * 3]), jnp.array([9]), jnp.array([True]),
                         jax.random.PRNGKey(0), sp=sp, max_new=8, out_len=8, stop_ids=stop,
                         drafter=d)
  assert int(st.bonus_B[0]) == 1     # the target's first token after "1 4 7 1 4 7 1 4 7"
  assert np.asarray(st.drafts_BxD[0]).tolist() == [4, 7, 1]


def test_a_drafter_with_tables_saves_loads_and_is_not_trained(target, tmp_path):
  d = ngram_drafter(target)
  path = checkpoint.save_drafter(str(tmp_path / "d"), d, target)
  back = fd.load_drafter(path, target)
  for k, v in d.params["ngram"].items():
    assert back.params["ngram"][k].dtype == v.dtype, k
    np.testing.assert_array_equal(np.asarray(back.params["ngram"][k]), np.asarray(v))
  assert back.config == d.config and back.config.rescores
  assert "ngram" not in trainable(back.params)
  shapes = jax.eval_shape(lambda tp: init_draft_params(tp, target.config, d.config,
                                                       jax.random.PRNGKey(0)), target.params)
  assert shapes["ngram"]["tri_key"].shape == d.params["ngram"]["tri_key"].shape
  with pytest.raises(fd.FlexDraftError, match="rescore_top=40"):
    DrafterConfig(rescore_top=40, context_bigram=1.0).validate(target.config)
  with pytest.raises(fd.FlexDraftError, match="bigrams"):
    DrafterConfig(ngram_trigrams=3).validate(target.config)
  assert not DrafterConfig().rescores


def test_add_ngram_counts_the_training_split_and_keeps_the_held_out_best(tmp_path):
  import os
  import subprocess
  import sys
  from flexdraft_jax.training import data, regen_store
  from tests import tiny
  t = tiny.tiny_target()
  regen = str(tmp_path / "regen")
  tiny.write_fake_regen(regen, t, n=24)
  src = checkpoint.save_drafter(str(tmp_path / "d"), random_drafter(t, noise=0.5), t)
  out = str(tmp_path / "out")
  r = subprocess.run(
      [sys.executable, "-m", "flexdraft_jax", "add-ngram", "--config=configs/tiny_test.py",
       f"--config.data.regen_dir={regen}", f"--drafter={src}", f"--out={out}", "--top=8",
       "--grid=0:0:0,1:3:2"], cwd=tiny.REPO, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=tiny.REPO))
  assert r.returncode == 0, r.stderr[-2000:]
  rows = [line.split("|")[1:5] for line in r.stdout.splitlines() if line.startswith("| ")
          and line[2].isdigit()]
  taus = {(float(a), float(b), float(c)): float(tau) for a, b, c, tau in rows}
  assert len(taus) == 2
  d = fd.load_drafter(out, t)
  chosen = (d.config.ngram_weight, d.config.context_trigram, d.config.context_bigram)
  assert taus[chosen] == max(taus.values()) and d.config.rescore_top == 8
  train, held = data.split_eval(regen_store.load_records(regen), 4)
  want = ngram.build_tables([np.concatenate([x.prompt_ids[-2:], x.answer_ids]) for x in train],
                            np.arange(t.config.vocab_size), t.config.vocab_size)
  for k, v in want.items():
    np.testing.assert_array_equal(np.asarray(d.params["ngram"][k]), v)
  assert d.config.ngram_trigrams == len(want["tri_key"]) > 0
