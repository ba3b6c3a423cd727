"""Where a sequential decode step of SmolLM2-135M + the shipped drafter goes (ms).

  PYTHONPATH=. python launch/experiments/profile_spec_step.py --batch=1 --ks=1,2,4,8

A sequential step at verify length k is (1) the target over the k-position
verify block, with the LM head at every position, then (2) the draft pass: one
mask block through the deep layers, the draft head and the calibration. This
times each part by itself, through the library's own functions, on a decode
state made by real decoding (a GSM8K-style prompt, the chat template):
  forward_k{k}        the target over k positions + LM head + argmax
  body_k1             the same at k = 1 without the LM head
  lm_head_k{k}        the greedy LM head alone on k positions, as decoding runs
                      it (transformer.greedy_tokens: a [V, k] product + argmax)
  lm_head_logits_k{k} the same through [k, V] logits (how it ran before)
  draft_pass          deep layers over the mask block + draft head + calibration
  draft_deep_layers   its deep layers alone (hidden states of the mask block)
  draft_tokens        its draft head + calibration + argmax alone
  step_ar, step_seq_k{k}   one whole step of the jitted decode loop
On a CPU the LM head is a memory-bound matrix-vector product at k = 1; from
k = 2 on the [k, V] product is a much slower small matrix-matrix product, which
the [V, k] form avoids in part; compare `lm_head_k*` and `lm_head_logits_k*`.
"""

from __future__ import annotations

import functools
import json
import time

from absl import app, flags

from flexdraft_jax.decoding import capture

flags.DEFINE_integer("batch", 1, "rows per step")
flags.DEFINE_list("ks", ["1", "2", "4", "8"], "verify lengths to time")
flags.DEFINE_integer("reps", 20, "timed calls per part (mean reported)")
flags.DEFINE_enum("draft_dtype", "auto", ["auto", "bfloat16", "target"],
                  "the draft pass's matmul weights (generate's draft_dtype)")
flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8", "drafter directory")
FLAGS = flags.FLAGS

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as "
          "many clips in May. How many clips did Natalia sell altogether in April and May?")


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  import flexdraft_jax as fd
  from flexdraft_jax.decoding import chunk, verify
  from flexdraft_jax.decoding.state import KV_BLOCK, deep_pass, draft_tokens
  from flexdraft_jax.drafter.model import Drafter
  from flexdraft_jax.evaluation import plan
  from flexdraft_jax.model import transformer

  target = fd.load_target("smollm2-135m", layout="layers")
  drafter = fd.load_drafter(plan.resolve_path(FLAGS.drafter), target)
  ks = [int(k) for k in FLAGS.ks]
  # The decode state of a real run: the first chunk's arguments, copied before
  # the chunk consumes (donates) them.
  (tp, dp, state), kw = capture.first_chunk(target, drafter, [PROMPT] * FLAGS.batch,
                                                draft_dtype=FLAGS.draft_dtype)
  real = chunk.run_chunk
  cfg, dcfg, sp = kw["cfg"], kw["dcfg"], kw["sp"]

  def ms(f, *args):
    f = jax.jit(f)
    for _ in range(2):  # compile + warm
      jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(FLAGS.reps):
      out = f(*args)
    jax.block_until_ready(out)
    return round(1e3 * (time.perf_counter() - t) / FLAGS.reps, 2)

  def forward(tp, st, k, head):
    block = jnp.zeros((st.bonus_B.shape[0], k), jnp.int32)
    pos = st.length_B[:, None] + jnp.arange(k)[None]
    h, _, cache = transformer.forward(tp, cfg, st.cache, block, pos, kv_block=KV_BLOCK)
    first_cache = jax.tree.leaves(cache)[0]
    return (transformer.greedy_tokens(tp, cfg, h) if head else h), first_cache

  def draft_pass(tp, dp, st):
    return verify.refresh_drafts(tp, cfg, Drafter(dcfg, dp), st, sp=sp).drafts_BxD

  def draft_deep_layers(tp, dp, st):
    return deep_pass(tp, cfg, Drafter(dcfg, dp), st.cache, st.length_B, st.bonus_B, "xla")

  def drafts_from(tp, dp, hm, st):
    return draft_tokens(tp, cfg, Drafter(dcfg, dp), hm, st.bonus_B, sp,
                        jax.random.PRNGKey(0), st.hist_BxL, st.length_B)[0]

  def step(tp, dp, st, mode, k):  # one step of the decode loop (donation off inside jit)
    return real(tp, dp, st, **dict(kw, mode=mode, num_groups=k, n_steps=jnp.int32(1))).bonus_B

  B = FLAGS.batch
  out = {"batch": B, "draft_dtype": FLAGS.draft_dtype, "cache_slots": int(jax.tree.leaves(state.cache)[0].shape[2])}
  out["body_k1"] = ms(functools.partial(forward, k=1, head=False), tp, state)
  for k in ks:
    out[f"forward_k{k}"] = ms(functools.partial(forward, k=k, head=True), tp, state)
    h = jnp.zeros((B, k, cfg.hidden_size), jnp.float32)
    out[f"lm_head_k{k}"] = ms(lambda tp, h: transformer.greedy_tokens(tp, cfg, h), tp, h)
    out[f"lm_head_logits_k{k}"] = ms(lambda tp, h: transformer.logits(tp, cfg, h).argmax(-1),
                                     tp, h)
  out["draft_pass"] = ms(draft_pass, tp, dp, state)
  out["draft_deep_layers"] = ms(draft_deep_layers, tp, dp, state)
  hm = jax.jit(draft_deep_layers)(tp, dp, state)
  out["draft_tokens"] = ms(drafts_from, tp, dp, hm, state)
  out["step_ar"] = ms(functools.partial(step, mode="ar", k=0), tp, dp, state)
  for k in ks:
    if k >= 2:
      out[f"step_seq_k{k}"] = ms(functools.partial(step, mode="sequential", k=k), tp, dp,
                                 state)
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
