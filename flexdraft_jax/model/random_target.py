"""Random tiny targets: `load_target("random:NAME[:SEED]")` (model/loading.py).

A randomly initialised tiny model with a byte tokenizer, for tests and the
`tiny_test` config. NAME is one of RANDOM_CONFIGS:
`tiny` (Llama-style, tied embeddings), `tiny-qwen3` (qk-norm, untied head),
`tiny-qwen2` (q/k/v biases); `smollm2-135m-shape` (SmolLM2-135M's shapes, for
timing).
"""

from __future__ import annotations

import hashlib
import json

import jax.numpy as jnp
import numpy as np

from flexdraft_jax.model import pytree, weights
from flexdraft_jax.model.config import FlexDraftError, ModelConfig, Target


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, then specials; a ChatML-like template."""
  PAD, BOS, EOS, IM_START, IM_END = 256, 257, 258, 259, 260
  vocab_size = 264
  eos_token_ids = (EOS, IM_END)

  def encode(self, text: str, **_):
    return list(text.encode("utf-8"))

  def decode(self, ids, **_):
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", "replace")

  def apply_chat_template(self, messages_or_text, add_generation_prompt=True, **_):
    msgs = messages_or_text
    if isinstance(msgs, str):
      msgs = [{"role": "user", "content": msgs}]
    ids = [self.BOS]
    for m in msgs:
      ids += [self.IM_START] + self.encode(f"{m['role']}\n{m['content']}")
      ids += [self.IM_END] + self.encode("\n")
    if add_generation_prompt:
      ids += [self.IM_START] + self.encode("assistant\n")
    return ids


_BASE = dict(vocab_size=ByteTokenizer.vocab_size, hidden_size=64,
             intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
             head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
             bos_token_id=ByteTokenizer.BOS,
             eos_token_ids=ByteTokenizer.eos_token_ids,
             pad_token_id=ByteTokenizer.PAD, max_position_embeddings=2048)
RANDOM_CONFIGS = {
    "tiny": ModelConfig(**_BASE),
    "tiny-qwen3": ModelConfig(**_BASE, qk_norm=True, tie_embeddings=False,
                              model_type="qwen3"),
    "tiny-qwen2": ModelConfig(**_BASE, attention_bias=True, model_type="qwen2"),
    # SmolLM2-135M's shapes with random weights: times the real model's steps
    # (launch/experiments/bench_train.py, launch/device_pipeline.py's --probe) where its
    # weights are not at hand.
    "smollm2-135m-shape": ModelConfig(**dict(
        _BASE, vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        rope_theta=100000.0, rms_norm_eps=1e-5)),
}


def random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32):
  """A target pytree (layout in model/pytree.py) with N(0, 0.02²) weights
  and unit norms; small random norm perturbations so norms are not trivially 1."""
  rng = np.random.default_rng(seed)
  n, H, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
  Q, KV, D = cfg.q_size, cfg.kv_size, cfg.head_dim

  def w(*shape, std=0.02):
    return jnp.asarray(rng.normal(0.0, std, shape), dtype)

  def norm(*shape):
    return jnp.asarray(1.0 + rng.normal(0.0, 0.1, shape), dtype)

  layers = {"input_norm": norm(n, H), "post_norm": norm(n, H),
            "q": w(n, H, Q), "k": w(n, H, KV), "v": w(n, H, KV), "o": w(n, Q, H),
            "gate": w(n, H, F), "up": w(n, H, F), "down": w(n, F, H)}
  if cfg.attention_bias:
    layers.update(q_bias=w(n, Q), k_bias=w(n, KV), v_bias=w(n, KV))
  if cfg.qk_norm:
    layers.update(q_norm=norm(n, D), k_norm=norm(n, D))
  # Embeddings larger than the other weights so tokens are distinguishable.
  params = {"embed": w(cfg.vocab_size, H, std=0.25), "final_norm": norm(H),
            "layers": layers}
  if not cfg.tie_embeddings:
    params["lm_head"] = w(H, cfg.vocab_size, std=0.1)
  return params


def random_target(name: str = "tiny", seed: int = 0, dtype=jnp.float32) -> Target:
  if name not in RANDOM_CONFIGS:
    raise FlexDraftError(f"unknown random target {name!r} "
                         f"(known: {', '.join(RANDOM_CONFIGS)})")
  cfg = RANDOM_CONFIGS[name]
  fp = hashlib.sha256(json.dumps([repr(cfg), seed]).encode()).hexdigest()[:16]
  return Target(cfg, random_params(cfg, seed, dtype), ByteTokenizer(),
                      f"random:{name}:{seed}", fp)


def load(spec: str, dtype, layout: str = "stacked") -> Target:
  """`random:NAME[:SEED]` in either layout (see model/loading.py)."""
  parts = spec.split(":")
  if len(parts) > 3 or (len(parts) == 3 and not parts[2].isdigit()):
    raise FlexDraftError(f"random target spec must be random:NAME[:SEED], got {spec!r}")
  weights.check_layout(layout)
  t = random_target(parts[1], int(parts[2]) if len(parts) == 3 else 0, jnp.dtype(dtype))
  return t if layout == "stacked" else t._replace(params=pytree.unstack_layers(t.params))
