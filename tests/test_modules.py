"""The target and the drafter as Flax modules: what `init` builds, and an
optimizer that trains the draft collection only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tests import tiny

from flexdraft_jax.drafter.model import (Drafter, DrafterConfig, DraftModel, draft_logits,
                                         init_draft_params, num_params)
from flexdraft_jax.model import pytree, transformer
from flexdraft_jax.model.random_target import RANDOM_CONFIGS
from flexdraft_jax.training import steps
from flexdraft_jax.training.config import base_config

# A target shape no test builds otherwise: untied head, biases, 5 layers.
NEW_SHAPE = dataclasses.replace(
    RANDOM_CONFIGS["tiny"], hidden_size=48, intermediate_size=80, num_layers=5,
    num_heads=6, num_kv_heads=3, head_dim=8, attention_bias=True, qk_norm=True,
    tie_embeddings=False)


def test_init_builds_a_drafter_for_a_new_target_shape():
  cfg, dcfg = NEW_SHAPE, DrafterConfig(num_layers=2, block_size=4, calib_rank=8)
  variables = DraftModel.of(cfg, dcfg).init(jax.random.PRNGKey(0), method="weights")
  target, draft = variables["params"], variables["draft"]
  # the target as the modules declare it, the loaders' layout
  assert {k: v.shape for k, v in target.items() if k != "layers"} == \
      pytree.global_shapes(cfg)
  assert {k: v.shape[1:] for k, v in target["layers"].items()} == \
      pytree.layer_shapes(cfg)
  # the drafter: the attention of the last 2 layers (copied), mask, calibration
  assert sorted(draft) == ["calib", "layers", "mask"]
  assert sorted(draft["layers"]) == sorted(
      k for k in pytree.layer_shapes(cfg) if k in pytree.ATTN_KEYS)
  for k, w in draft["layers"].items():
    np.testing.assert_array_equal(w, target["layers"][k][-2:])
  assert draft["mask"].shape == (48,)
  assert draft["calib"]["w2"].shape == (8, cfg.vocab_size)
  assert not np.any(draft["calib"]["w2"])  # calibration starts as the identity
  # given a target, init copies that one (the trainer's path); only the random
  # draws differ (the target's own init drew first above)
  again = init_draft_params(target, cfg, dcfg, jax.random.PRNGKey(0))
  assert jax.tree.map(jnp.shape, again) == jax.tree.map(jnp.shape, draft)
  jax.tree.map(np.testing.assert_array_equal, again["layers"], draft["layers"])
  np.testing.assert_array_equal(again["calib"]["w2"], draft["calib"]["w2"])
  # and the pair runs: one mask group through the deep layers, drafted
  masks = pytree.MaskRows(jnp.array([[3, 4, 5, 6]]), jnp.array([[2] * 4]),
                               jnp.zeros((4,), jnp.int32))
  cache = pytree.KVCache.zeros(cfg, 1, 8, jnp.float32)
  _, hm, _ = transformer.Transformer(cfg).apply(
      variables, cache, None, None, masks=masks, num_draft_layers=2, method="forward")
  lg = draft_logits(target, cfg, Drafter(dcfg, draft), hm, jnp.ones((1, 4), jnp.int32))
  assert lg.shape == (1, 4, cfg.vocab_size) and np.all(np.isfinite(lg))


def test_optax_updates_the_draft_collection_and_leaves_the_trunk_unchanged():
  t = tiny.tiny_target()
  dcfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=8, ngram_bigrams=4)
  draft = init_draft_params(t.params, t.config, dcfg, jax.random.PRNGKey(0))
  variables = steps.optimizer_variables(t.params, draft)
  labels = steps.param_labels(variables)
  assert labels["params"] == steps.FROZEN and labels["draft"]["ngram"] == steps.FROZEN
  assert {labels["draft"][k] for k in ("mask", "layers", "calib")} == {steps.TRAINED}
  tc = base_config("x").train
  tx, _ = steps.make_optimizer(tc)
  opt_state = tx.init(variables)
  # no optimizer state for the trunk
  trained = {k: v for k, v in draft.items() if k != "ngram"}
  assert num_params(opt_state) <= 2 * num_params(trained) + 8
  # gradients everywhere, the trunk's included: only the draft's weights move
  grads = jax.tree.map(lambda x: jnp.ones(x.shape, jnp.float32), variables)
  for _ in range(2):
    updates, opt_state = tx.update(grads, opt_state, variables)
    new = optax.apply_updates(variables, updates)
  jax.tree.map(np.testing.assert_array_equal, new["params"], t.params)
  jax.tree.map(np.testing.assert_array_equal, new["draft"]["ngram"], draft["ngram"])
  moved = jax.tree.map(lambda a, b: not np.array_equal(a, b), new["draft"], draft)
  assert all(jax.tree.leaves({k: moved[k] for k in trained}))
