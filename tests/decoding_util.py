"""A tiny random target with *peaked* logits (distinct top-2) and random drafters."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax.drafter.model import Drafter, DrafterConfig, init_draft_params
from flexdraft_jax.model.config import ModelConfig
from flexdraft_jax.model.loading import Target


class IdTokenizer:
  """Prompts are space-separated ids; good enough for engine tests."""
  bos_token_id = None

  def encode(self, text, **_):
    return [int(x) for x in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(i)) for i in ids)

  def apply_chat_template(self, text, **_):
    return self.encode(text)


def tiny_target(vocab=64, layers=4, seed=0, qk_norm=True, eos=1, scale=0.35):
  cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                    num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8,
                    qk_norm=qk_norm, eos_token_ids=(eos,), max_position_embeddings=1024,
                    bos_token_id=None)
  r = np.random.RandomState(seed)
  n, H, F, V = layers, 32, 64, vocab

  def w(*s, std=scale):
    return jnp.asarray(r.randn(*s).astype(np.float32) * std)

  params = {
      "embed": w(V, H, std=1.0), "final_norm": 1 + w(H, std=0.2),
      "layers": {"input_norm": 1 + w(n, H, std=0.2), "post_norm": 1 + w(n, H, std=0.2),
                 "q": w(n, H, 32), "k": w(n, H, 16), "v": w(n, H, 16), "o": w(n, 32, H),
                 "gate": w(n, H, F), "up": w(n, H, F), "down": w(n, F, H)}}
  if qk_norm:
    params["layers"]["q_norm"] = 1 + w(n, 8, std=0.2)
    params["layers"]["k_norm"] = 1 + w(n, 8, std=0.2)
  return Target(cfg, params, IdTokenizer(), f"tiny-{seed}", f"fp-tiny-{seed}-{vocab}")


def random_drafter(target, num_layers=2, block_size=4, seed=1, noise=0.0):
  dcfg = DrafterConfig(num_layers=num_layers, block_size=block_size, calib_rank=16)
  p = init_draft_params(target.params, target.config, dcfg, jax.random.PRNGKey(seed))
  if noise:
    k = jax.random.PRNGKey(seed + 100)
    p["calib"]["w2"] = noise * jax.random.normal(k, p["calib"]["w2"].shape)
  return Drafter(dcfg, p, target.fingerprint)


def bigram_drafter(target, num_layers=2, scale=30.0, block_size=2):
  """A drafter whose every slot drafts the target's favourite successor of the
  bonus token — built in closed form through the calibration MLP, so first
  drafts are often accepted (acceptance paths get exercised) without training.

  w1 maps embed(bonus) to a one-hot of the bonus id; w2 maps that one-hot to a
  large logit on f(bonus) = argmax of the target after the single token bonus.
  """
  from flexdraft_jax import target_logits
  cfg = target.config
  V, H = cfg.vocab_size, cfg.hidden_size
  d = random_drafter(target, num_layers=num_layers, block_size=block_size)
  dcfg = DrafterConfig(num_layers=num_layers, block_size=block_size, calib_rank=V)
  succ = np.asarray(target_logits(target, np.arange(V)[:, None]))[:, 0].argmax(-1)
  E = np.asarray(target.params["embed"], np.float64)
  w1 = np.zeros((2 * H, V))
  w1[:H] = np.linalg.pinv(E) * scale            # embed(b) @ w1 ≈ scale · onehot(b)
  w2 = np.zeros((V, V))
  w2[np.arange(V), succ] = 1.0
  params = dict(d.params)
  params["calib"] = {"w1": jnp.asarray(w1, jnp.float32), "b1": jnp.zeros((V,)),
                     "w2": jnp.asarray(w2, jnp.float32), "b2": jnp.zeros((V,))}
  return Drafter(dcfg, params, target.fingerprint)


def vocab_drafter(drafter, ids):
  """`drafter` restricted to the draft vocabulary `ids` (SPEC §7): the same
  weights, calibration columns taken by id. Where the full drafter's argmax is
  in `ids`, both draft the same token."""
  ids = np.asarray(ids, np.int32)
  c = drafter.params["calib"]
  params = dict(drafter.params, vocab=jnp.asarray(ids),
                calib=dict(c, w2=c["w2"][:, ids], b2=c["b2"][ids]))
  dcfg = dataclasses.replace(drafter.config, draft_vocab=len(ids))
  return Drafter(dcfg, params, drafter.target_fingerprint)


def ngram_drafter(target, block_size=4, weight=0.5, context=(1.0, 0.5), top=0, answers=None):
  """A random drafter with the n-gram prior (`drafter.ngram`): tables counted
  over `answers` (default: the target's own greedy continuations of random
  prompts, so the prior knows its habits) and the row-text weights `context`."""
  from flexdraft_jax import generate
  from flexdraft_jax.drafter import ngram
  cfg = target.config
  d = random_drafter(target, block_size=block_size, noise=0.5)
  if answers is None:
    r = np.random.RandomState(7)
    prompts = [r.randint(2, cfg.vocab_size, size=4).tolist() for _ in range(24)]
    out = generate(target, prompts, max_new_tokens=24, stop=[])
    answers = [p[-2:] + list(o) for p, o in zip(prompts, out.token_ids)]
  tables = ngram.build_tables(answers, np.arange(cfg.vocab_size), cfg.vocab_size)
  dcfg = dataclasses.replace(
      d.config, ngram_weight=weight, context_trigram=context[0], context_bigram=context[1],
      rescore_top=top or cfg.vocab_size, ngram_bigrams=len(tables["bi_key"]),
      ngram_contexts=len(tables["ctx_key"]), ngram_trigrams=len(tables["tri_key"]))
  return Drafter(dcfg, dict(d.params, ngram=jax.tree.map(jnp.asarray, tables)),
                 target.fingerprint)
