"""The draft pytree (SPEC §1) and its on-disk format."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import tiny  # noqa: E402

from flexdraft_jax.drafter import checkpoint as ckpt  # noqa: E402
from flexdraft_jax.drafter.model import (Drafter, DrafterConfig, DraftModel,  # noqa: E402
                                         draft_logits, init_draft_params, num_params)
from flexdraft_jax.model.config import FlexDraftError, ModelConfig  # noqa: E402

DCFG = DrafterConfig(num_layers=2, block_size=4, calib_rank=8)

SMOLLM2_135M = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)


def _drafter(t, dcfg=DCFG, seed=0):
  params = init_draft_params(t.params, t.config, dcfg, jax.random.PRNGKey(seed))
  params = jax.tree.map(lambda x: x + 0.01 * jnp.ones_like(x), params)  # non-trivial
  return Drafter(dcfg, params, t.fingerprint)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3", "tiny-qwen2"])
def test_draft_pytree_follows_spec(name):
  t = tiny.tiny_target(name)
  cfg = t.config
  p = init_draft_params(t.params, cfg, DCFG, jax.random.PRNGKey(0))
  want = {"q", "k", "v", "o"} | ({"q_norm", "k_norm"} if cfg.qk_norm else set()) \
      | ({"q_bias", "k_bias", "v_bias"} if cfg.attention_bias else set())
  assert set(p["layers"]) == want
  for k in want:  # copies of the target's last L layers
    np.testing.assert_array_equal(p["layers"][k], t.params["layers"][k][-2:])
  assert p["mask"].shape == (cfg.hidden_size,)
  assert 0.005 < float(jnp.std(p["mask"])) < 0.05
  H, V = cfg.hidden_size, cfg.vocab_size
  assert p["calib"]["w1"].shape == (2 * H, 8) and p["calib"]["w2"].shape == (8, V)
  # zero last layer: calibration starts as the identity
  hm = jax.random.normal(jax.random.PRNGKey(1), (2, 4, H))
  bonus = jnp.zeros((2, 4), jnp.int32)
  d = Drafter(DCFG, p)
  np.testing.assert_array_equal(draft_logits(t.params, cfg, d, hm, bonus),
                                draft_logits(t.params, cfg, d, hm, bonus, calibrate=False))


def test_low_rank_tied_calibration():
  t = tiny.tiny_target("tiny-qwen3")
  dcfg = DrafterConfig(num_layers=2, block_size=4, calib_rank=8, calib_tied=True)
  d = _drafter(t, dcfg)
  assert d.params["calib"]["w2"].shape == (8, t.config.hidden_size)
  hm = jax.random.normal(jax.random.PRNGKey(1), (1, 4, t.config.hidden_size))
  out = draft_logits(t.params, t.config, d, hm, jnp.ones((1, 4), jnp.int32))
  assert out.shape == (1, 4, t.config.vocab_size) and bool(jnp.all(jnp.isfinite(out)))


def test_save_load_round_trip(tmp_path):
  t = tiny.tiny_target("tiny-qwen3")
  d = _drafter(t)
  path = ckpt.save_drafter(str(tmp_path / "d"), d, t,
                           training={"steps": 7, "tokens_seen": 123, "data": "fake"})
  got = ckpt.load_drafter(path, t)
  assert got.config == d.config and got.target_fingerprint == t.fingerprint
  want = ckpt.flatten(d.params)
  for k, v in ckpt.flatten(got.params).items():
    assert v.dtype == t.params["embed"].dtype
    np.testing.assert_array_equal(
        v, np.asarray(want[k]).astype(jnp.bfloat16).astype(np.float32))
  meta = json.load(open(os.path.join(path, "drafter.json")))
  assert meta["training"]["tokens_seen"] == 123
  assert meta["target"]["num_layers"] == t.config.num_layers
  # saving again over it is atomic, leaves no temporary directories and keeps
  # what else the directory holds (its card); both readable by others
  with open(os.path.join(path, "README.md"), "w") as f:
    f.write("card")
  ckpt.save_drafter(path, d, t)
  assert os.listdir(tmp_path) == ["d"]
  assert sorted(os.listdir(path)) == ["README.md", "drafter.json", "params.safetensors"]
  assert open(os.path.join(path, "README.md")).read() == "card"
  assert os.stat(path).st_mode & 0o055 and os.stat(
      os.path.join(path, "params.safetensors")).st_mode & 0o044
  # loaded in a bf16 target's dtype
  t16 = t._replace(params=jax.tree.map(lambda x: x.astype(jnp.bfloat16), t.params))
  assert ckpt.load_drafter(path, t16).params["mask"].dtype == jnp.bfloat16


@pytest.mark.parametrize("other", ["layers", "hidden", "vocab", "fingerprint"])
def test_drafter_for_another_target_is_refused(tmp_path, other):
  t = tiny.tiny_target("tiny")
  path = ckpt.save_drafter(str(tmp_path / "d"), _drafter(t), t)
  cfg = t.config
  changes = {"layers": dict(num_layers=cfg.num_layers + 1),
             "hidden": dict(hidden_size=cfg.hidden_size * 2),
             "vocab": dict(vocab_size=cfg.vocab_size + 8), "fingerprint": {}}[other]
  import dataclasses
  t2 = t._replace(config=dataclasses.replace(cfg, **changes),
                  fingerprint=t.fingerprint if changes else "0" * 16)
  with pytest.raises(FlexDraftError) as e:
    ckpt.load_drafter(path, t2)
  assert "\n" not in str(e.value) and "made for target" in str(e.value)


def test_missing_or_corrupt_drafter_is_refused(tmp_path):
  t = tiny.tiny_target()
  with pytest.raises(FlexDraftError, match="no drafter"):
    ckpt.load_drafter(str(tmp_path / "nope"), t)
  path = ckpt.save_drafter(str(tmp_path / "d"), _drafter(t), t)
  with open(os.path.join(path, "params.safetensors"), "r+b") as f:
    f.truncate(100)
  with pytest.raises(FlexDraftError, match="corrupt") as e:
    ckpt.load_drafter(path, t)
  assert "\n" not in str(e.value)
  with open(os.path.join(path, "drafter.json"), "w") as f:
    f.write("{not json")
  with pytest.raises(FlexDraftError, match="corrupt"):
    ckpt.load_drafter(path, t)


def test_save_refuses_a_drafter_of_another_target(tmp_path):
  t = tiny.tiny_target()
  d = _drafter(t)._replace(target_fingerprint="f" * 16)
  with pytest.raises(FlexDraftError):
    ckpt.save_drafter(str(tmp_path / "d"), d, t)


@pytest.mark.parametrize("L", [4, 5, 6])
def test_smollm2_drafter_fits_50mb_in_bf16(L):
  # The module's init builds the drafter for the target's shape, weights unseen.
  model = DraftModel.of(SMOLLM2_135M, DrafterConfig(num_layers=L))
  p = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), method="weights"))["draft"]
  assert p["layers"]["k"].shape == (L, 576, 192)
  assert num_params(p) * 2 + 4096 <= 50e6


def test_saved_size_matches_parameters(tmp_path):
  t = tiny.tiny_target()
  d = _drafter(t)
  path = ckpt.save_drafter(str(tmp_path / "d"), d, t)
  tensor_bytes = os.path.getsize(os.path.join(path, "params.safetensors"))
  assert num_params(d.params) * 2 <= tensor_bytes <= num_params(d.params) * 2 + 8192
