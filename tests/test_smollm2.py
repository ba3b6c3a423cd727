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
  with drafts accepted in parallel and sequential mode (it was trained to draft
  before the bonus is known, too)."""
  import os
  from flexdraft_jax.evaluation.plan import resolve_path
  from flexdraft_jax.evaluation.sweep import SHIPPED_DRAFTER
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
                      mode=mode, speculation=fd.SpecOptions(cost_cache=None))
    for x, a, b in zip(ids, ref.token_ids, out.token_ids):
      assert _agree(smollm2_target, x, a, b), mode
    if mode != "flex":   # flex may run AR steps at batch 3 on a CPU (its costs say so)
      assert out.stats["tau"] > 1.5, (mode, out.stats["tau"])
  assert os.path.getsize(os.path.join(resolve_path(SHIPPED_DRAFTER),
                                      "params.safetensors")) <= 50e6



@pytest.mark.slow
def test_draft_trees_decode_losslessly(smollm2_target):
  """Draft trees with the shipped drafter on a math, a code and a chat prompt:
  sequential steps verifying trees (and flex weighing them) decode exactly what
  AR does, and a tree accepts more a step than the chain."""
  from flexdraft_jax.evaluation.plan import resolve_path
  from flexdraft_jax.evaluation.sweep import SHIPPED_DRAFTER
  drafter = fd.load_drafter(resolve_path(SHIPPED_DRAFTER), smollm2_target)
  prompts = [PROMPTS[2], "Complete this Python function:\n\ndef fib(n):\n    \"\"\"Return "
             "the n-th Fibonacci number.\"\"\"\n", "Tell me about your favourite season."]
  ids = [smollm2_target.tokenizer.apply_chat_template(p) for p in prompts]
  ref = fd.generate(smollm2_target, ids, max_new_tokens=MAX_NEW)
  kw = dict(max_new_tokens=MAX_NEW, drafter=drafter)
  chain = fd.generate(smollm2_target, ids, mode="sequential", **kw)
  for mode, budget in (("sequential", 32), ("flex", 16)):
    out = fd.generate(smollm2_target, ids, mode=mode, **kw, speculation=fd.SpecOptions(
        tree_budget=budget, cost_cache=None))
    for x, a, b in zip(ids, ref.token_ids, out.token_ids):
      assert _agree(smollm2_target, x, a, b), (mode, budget)
    if mode == "sequential":
      assert out.stats["tau"] > chain.stats["tau"], (out.stats["tau"], chain.stats["tau"])
