"""Tiny random targets, fake regenerated data and configs for CPU tests."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from flexdraft_jax.model import random_target
from flexdraft_jax.training import regen_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_target(name: str = "tiny", seed: int = 0):
  """A random target (`random:NAME:SEED`): ModelConfig + params + byte tokenizer."""
  return random_target.random_target(name, seed)


def fake_records(target, n: int, seed: int = 0) -> list:
  """Shard records: a chat-templated prompt and a learnable answer (a short
  motif of letters repeated, then the end-of-turn token)."""
  rng = np.random.default_rng(seed)
  tok = target.tokenizer
  out = []
  for i in range(n):
    prompt = tok.apply_chat_template(f"question {i}: " + "x" * int(rng.integers(0, 6)))
    motif = list(rng.integers(ord("a"), ord("e"), size=3))
    answer = (motif * 8)[:int(rng.integers(10, 24))] + [tok.IM_END]
    out.append({"uid": f"fake:{i:04d}", "source": "fake",
                "prompt_ids": [int(t) for t in prompt],
                "answer_ids": [int(t) for t in answer]})
  return out


def write_fake_regen(regen_dir: str, target, n: int = 24, seed: int = 0) -> list:
  """Fake regenerated shards (4 records each) + the tfds dataset over them."""
  recs = fake_records(target, n, seed)
  for s in range(0, n, 4):
    regen_store.write_shard(regen_dir, s // 4, recs[s:s + 4])
  regen_store.build_dataset(regen_dir)
  return recs


def tiny_test_config():
  """configs/tiny_test.py as it is."""
  spec = importlib.util.spec_from_file_location(
      "tiny_test_config", os.path.join(REPO, "configs", "tiny_test.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def tiny_config(regen_dir: str, **train_overrides):
  """configs/tiny_test.py with `regen_dir` and train.* overrides."""
  c = tiny_test_config()
  c.data.regen_dir = regen_dir
  c.train.seq_len = 48  # fake_records are short (~40-60 tokens)
  for k, v in train_overrides.items():
    setattr(c.train, k, v)
  return c
