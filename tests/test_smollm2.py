"""SmolLM2-135M from the package: greedy generation equals HF transformers."""

import numpy as np
import pytest
import torch

import flexdraft_jax as fd

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half "
    "as many clips in May. How many clips did Natalia sell altogether?",
]
MAX_NEW = 24


def _hf_greedy(model, ids, eos):
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=list(eos), pad_token_id=eos[0])
  return out[0, len(ids):].tolist()


def _agree(target, prompt_ids, ref, out):
  """Identical, or diverging only where the target's top-2 logits tie (fp rounding)."""
  if ref == out:
    return True
  i = next((k for k, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
  lg = np.asarray(fd.target_logits(target, np.asarray([prompt_ids + ref[:i]])))[0, -1]
  top = np.sort(lg)[-2:]
  return top[1] - top[0] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_greedy_generation_matches_hf(smollm2_target, smollm2_hf_model, chat):
  tok = smollm2_target.tokenizer
  ours = fd.generate(smollm2_target, PROMPTS, max_new_tokens=MAX_NEW, chat=chat)
  for prompt, got in zip(PROMPTS, ours.token_ids):
    ids = tok.apply_chat_template(prompt) if chat else tok.encode(prompt)
    ref = _hf_greedy(smollm2_hf_model, ids, smollm2_target.config.eos_token_ids)
    assert _agree(smollm2_target, ids, ref, got), (prompt, ref, got)
  assert ours.stats["new_tokens"] == sum(len(t) for t in ours.token_ids)
  if chat:  # the chat model answers and stops: its EOS ends the row
    assert "Paris" in ours.texts[0]


@pytest.mark.slow
def test_shipped_drafter_drafts_losslessly(smollm2_target):
  """The committed drafter fits the builtin target, drafts from its draft
  vocabulary, and parallel, sequential and flex decode exactly what AR does,
  with drafts accepted in every mode (it was trained to draft before the bonus
  is known, too)."""
  import os
  from flexdraft_jax.evaluation.sweep import SHIPPED_DRAFTER, resolve_path
  drafter = fd.load_drafter(resolve_path(SHIPPED_DRAFTER), smollm2_target)
  k = drafter.config.draft_vocab
  assert k and drafter.params["vocab"].shape == (k,)
  assert drafter.config.rescores   # it drafts under its n-gram prior
  assert drafter.params["ngram"]["tri_key"].shape == (drafter.config.ngram_trigrams,)
  assert drafter.config.drafts_blind
  ids = [smollm2_target.tokenizer.apply_chat_template(p) for p in PROMPTS]
  ref = fd.generate(smollm2_target, ids, max_new_tokens=MAX_NEW)
  for mode in ("parallel", "sequential", "flex"):
    out = fd.generate(smollm2_target, ids, max_new_tokens=MAX_NEW, drafter=drafter,
                      mode=mode, cost_cache=None)
    for x, a, b in zip(ids, ref.token_ids, out.token_ids):
      assert _agree(smollm2_target, x, a, b), mode
    assert out.stats["tau"] > 1.5, (mode, out.stats["tau"])
  assert os.path.getsize(os.path.join(resolve_path(SHIPPED_DRAFTER),
                                      "params.safetensors")) <= 50e6


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_shipped_drafter_samples_the_targets_distribution(smollm2_target, mode):
  """T = 1, top-k 3: the first three tokens of many rows of one prompt follow
  the target's exact distribution (χ² over the 27 continuations)."""
  import itertools
  import jax
  from scipy import stats
  from flexdraft_jax.decoding.sampling import SamplingParams, processed_logits
  from flexdraft_jax.evaluation.sweep import SHIPPED_DRAFTER, resolve_path
  target = smollm2_target
  drafter = fd.load_drafter(resolve_path(SHIPPED_DRAFTER), target)
  prompt = target.tokenizer.apply_chat_template("Name a color.")
  sp = SamplingParams(temperature=1.0, top_k=3)
  probs = lambda seqs: np.asarray(jax.nn.softmax(processed_logits(
      fd.target_logits(target, np.asarray(seqs))[:, -1], sp), axis=-1), np.float64)
  p0 = probs([prompt])[0]
  top = np.flatnonzero(p0 > 0)
  exact = {}
  for a in top:
    p1 = probs([prompt + [int(a)]])[0]
    for b in np.flatnonzero(p1 > 0):
      p2 = probs([prompt + [int(a), int(b)]])[0]
      for c in np.flatnonzero(p2 > 0):
        exact[(int(a), int(b), int(c))] = p0[a] * p1[b] * p2[c]
  assert len(exact) == 27 and abs(sum(exact.values()) - 1) < 1e-6
  n = 1200
  out = fd.generate(target, [prompt] * n, max_new_tokens=3, temperature=1.0, top_k=3,
                    stop=[], seed=5, drafter=drafter, mode=mode, cost_cache=None)
  counts = dict.fromkeys(exact, 0)
  for t in out.token_ids:
    counts[tuple(t[:3])] += 1              # a KeyError: a continuation outside top-3
  keys = sorted(exact, key=exact.get)
  obs = np.array([counts[k] for k in keys], float)
  exp = np.array([exact[k] for k in keys]) * n
  while exp[0] < 5:                        # pool the rarest cells
    obs, exp = np.r_[obs[0] + obs[1], obs[2:]], np.r_[exp[0] + exp[1], exp[2:]]
  assert stats.chisquare(obs, exp).pvalue > 1e-3
  assert out.stats["tau"] > 1.05, out.stats["tau"]   # drafts were accepted: the rule ran
