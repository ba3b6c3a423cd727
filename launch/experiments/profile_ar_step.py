"""Where an AR decode step of SmolLM2-135M goes, on this machine (ms per step).

  PYTHONPATH=. python launch/experiments/profile_ar_step.py --batch=16 --context=110 --cache_slots=256

Each part runs `--iters` times inside one jitted loop (best of `--reps`),
through the library's own functions:
  step_stacked    forward + LM head + argmax on stacked weights (`lax.scan`
                  over layers; what training's layout decodes with)
  step_per_layer  the same on per-layer weights and caches (`layout="layers"`:
                  what the engine, CLI and demo decode with)
  step_full_attn  step_per_layer reading the whole cache (no `kv_block`)
  attention       cache write + blocked attention of every layer
  lm_head         final norm + LM head + argmax
and `layers_without_attention` = step_per_layer - attention - lm_head.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

flags.DEFINE_integer("batch", 16, "rows per step")
flags.DEFINE_integer("context", 110, "position of the token being decoded")
flags.DEFINE_integer("cache_slots", 256, "cache length S")
flags.DEFINE_integer("iters", 16, "steps per jitted loop")
flags.DEFINE_integer("reps", 3, "timed loops (best reported)")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  import flexdraft_jax as fd
  from flexdraft_jax.decoding.state import KV_BLOCK
  from flexdraft_jax.model import attention, pytree, transformer

  B, S, iters = FLAGS.batch, FLAGS.cache_slots, FLAGS.iters
  stacked = fd.load_target("smollm2-135m")
  cfg = stacked.config
  per_layer = pytree.unstack_layers(stacked.params)
  pos = jnp.full((B, 1), FLAGS.context, jnp.int32)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  tok0 = jnp.zeros((B,), jnp.int32)
  h0 = 0.1 * jax.random.normal(keys[0], (B, 1, cfg.hidden_size))
  q0 = 0.1 * jax.random.normal(keys[1], (B, 1, cfg.num_heads, cfg.head_dim))

  def cache(per_layer_cache):
    c = pytree.KVCache.zeros(cfg, B, S, jnp.float32, per_layer=per_layer_cache)
    return jax.tree.map(lambda x: x + 0.1, c)

  def looped(body, init, *args):
    f = jax.jit(lambda c, *a: jax.lax.fori_loop(0, iters, lambda i, c: body(c, *a), c),
                donate_argnums=0)
    out = f(jax.tree.map(jnp.copy, init), *args)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(FLAGS.reps):
      t = time.perf_counter()
      out = f(out, *args)
      jax.block_until_ready(out)
      best = min(best, time.perf_counter() - t)
    return 1e3 * best / iters

  def next_token(params, h):
    return jnp.argmax(transformer.logits(params, cfg, h)[:, 0], -1).astype(jnp.int32)

  def step(kv_block):
    def body(c, params):
      tok, kv = c
      h, _, kv = transformer.forward(params, cfg, kv, tok[:, None], pos, kv_block=kv_block)
      return next_token(params, h), kv
    return body

  def attn(c):
    q, ks, vs = c
    kv = q[:, :, :cfg.num_kv_heads]
    for i in range(cfg.num_layers):
      ks = ks[:i] + (ks[i].at[:, :, FLAGS.context].set(kv[:, 0]),) + ks[i + 1:]
      q = q + 1e-3 * attention.attend(q, ks[i], vs[i], pos, kv_block=KV_BLOCK)
    return q, ks, vs

  def head(h, params):
    return h + 1e-6 * next_token(params, h)[:, None, None].astype(h.dtype)

  out = {"batch": B, "context": FLAGS.context, "cache_slots": S,
         "step_stacked": looped(step(KV_BLOCK), (tok0, cache(False)), stacked.params),
         "step_per_layer": looped(step(KV_BLOCK), (tok0, cache(True)), per_layer),
         "step_full_attn": looped(step(None), (tok0, cache(True)), per_layer),
         "attention": looped(attn, (q0,) + tuple(cache(True))),
         "lm_head": looped(head, h0, per_layer)}
  out["layers_without_attention"] = out["step_per_layer"] - out["attention"] - out["lm_head"]
  print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
  app.run(main)
