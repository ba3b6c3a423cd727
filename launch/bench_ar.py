"""Greedy AR decode tokens/s of flexdraft_jax vs HF transformers, SmolLM2-135M, CPU.

Run (one command, from the repository root):
  PYTHONPATH=. python launch/bench_ar.py --batch_sizes=1,16 --max_new_tokens=128 \\
    --out=/tmp/bench_ar.json
  (add --breakdown for the per-step cost split of our AR step; --threads=N to
  pin both frameworks to N threads, default os.cpu_count().)

What is measured, per batch size B (B prompts, GSM8K test questions from
`--data_dir`/gsm8k/test.jsonl under SmolLM2's chat template; a fixed prompt
list if the file is missing). Both implementations get the *same* token ids,
greedy, stop tokens off, so each row produces exactly `--max_new_tokens` (M):
  ours: `flexdraft_jax.generate(..., mode="ar", stop=[])`; decode time is the
        engine's `decode_seconds` (prefill excluded, blocked on the result).
  HF:   `LlamaForCausalLM.generate` (torch fp32, the builtin's dequantized
        weights via tests/conftest.py:hf_llama_from_target, `--hf_attn`),
        `min_new_tokens=M` and no EOS. Decode time is taken *inside* the call:
        a StoppingCriteria records a timestamp after every token; the first
        fires right after the prefill token, so last - first covers the M-1
        decode forwards (and HF's per-step logits/criteria work). As a cross
        check the JSON also holds T(generate M) - T(generate 1).
  In both, the first token comes out of prefill, so decode tok/s is
  B * (M - 1) / decode time. Every timing is preceded by one untimed call
  (compilation / allocator warm-up) and is the median of `--repeats` calls.

Threads. `--threads=N` calls torch.set_num_threads(N) and, before jax is
imported, sets PJRT_NPROC=N: the XLA:CPU PJRT client sizes its intra-op Eigen
pool (and dispatch pool) from PJRT_NPROC/NPROC, else from the cores it may
run on (checked on jax 0.10.2: the process gains two threads per unit of
PJRT_NPROC). `--xla_cpu_multi_thread_eigen` is a recognised XLA flag (it only
switches the multi-threaded Eigen dot/conv path on or off, not the count);
the old `--intra_op_parallelism_threads` is *not* recognised: XLA aborts with
"Unknown flag in XLA_FLAGS". With N=1 we also pass
--xla_cpu_multi_thread_eigen=false.

Roofline at batch 1: every step streams all weights once (fp32; the tied
embedding counted once, as the LM head; the embedding row gather is
negligible), so achieved weight bandwidth = weight bytes * steps/s. It is set
against a measured copy bandwidth: np.copyto of a `--copy_mb` buffer, counted
as read + write bytes (2 * size / time), single thread and `--threads`
threads (one slice each).

Timings on a shared machine are noisy: check `uptime` and rerun. Under
oversubscription (load average above the core count) multi-threaded runs
degrade badly, torch's OpenMP GEMMs most (several x at batch 16); compare
with --threads=1 there.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "16"], "Batch sizes.")
flags.DEFINE_integer("max_new_tokens", 128, "New tokens per row (exactly; stops off).")
flags.DEFINE_integer("prompt_len", 0, "0: natural GSM8K chat prompts (55-140 tokens, mean ~95, "
                     "system prompt included); N > 0: every prompt exactly N tokens (questions "
                     "concatenated / cut inside the user turn).")
flags.DEFINE_string("data_dir", "", "Folder with gsm8k/test.jsonl (default: "
                    "$FLEXDRAFT_DATA, else ../shared/data).")
flags.DEFINE_integer("threads", os.cpu_count(), "Threads for torch and XLA:CPU.")
flags.DEFINE_integer("repeats", 3, "Timed calls per configuration (median reported).")
flags.DEFINE_enum("hf_attn", "sdpa", ["sdpa", "eager"], "HF attention implementation.")
flags.DEFINE_bool("skip_hf", False, "Only time flexdraft_jax.")
flags.DEFINE_bool("breakdown", False, "Also time the parts of our AR step.")
flags.DEFINE_integer("copy_mb", 256, "Buffer size of the memory-bandwidth probe.")
flags.DEFINE_string("out", None, "Write the results as JSON here.")

FALLBACK_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?",
    "Explain how a hash table handles collisions, with a short example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between TCP and UDP? Answer in a few bullet points.",
]


def _set_threads(n: int):
  """Must run before jax (and ideally torch) is imported."""
  os.environ["PJRT_NPROC"] = str(n)
  os.environ.setdefault("OMP_NUM_THREADS", str(n))
  if n == 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_multi_thread_eigen=false").strip()


# ---- prompts -----------------------------------------------------------------

def _questions(data_dir: str, n: int) -> tuple:
  path = os.path.join(data_dir, "gsm8k", "test.jsonl")
  if not os.path.isfile(path):
    return [FALLBACK_PROMPTS[i % len(FALLBACK_PROMPTS)] for i in range(n)], "fallback"
  with open(path) as f:
    qs = [json.loads(line)["question"] for _, line in zip(range(max(n, 8)), f)]
  return qs, path


def prompt_ids(tok, questions: list, n: int, prompt_len: int) -> list:
  """`n` chat-templated prompts as id lists (exactly `prompt_len` ids if > 0)."""
  if prompt_len <= 0:
    return [tok.apply_chat_template(questions[i % len(questions)]) for i in range(n)]
  marker = "\x00Q\x00"
  pre, post = tok.render_chat(marker).split(marker)
  pre_ids = tok.encode(pre, add_special_tokens=False)
  post_ids = tok.encode(post, add_special_tokens=False)
  room = prompt_len - len(pre_ids) - len(post_ids)
  if room < 1:
    raise ValueError(f"--prompt_len must exceed the chat wrapper's "
                     f"{len(pre_ids) + len(post_ids)} tokens")
  out = []
  for i in range(n):
    body, j = [], i
    while len(body) < room:  # this row's question, then the next ones
      body += tok.encode(questions[j % len(questions)] + "\n\n", add_special_tokens=False)
      j += 1
    out.append(pre_ids + body[:room] + post_ids)
  return out


# ---- memory bandwidth --------------------------------------------------------

def copy_bandwidth(mb: int, threads: int, reps: int = 5) -> dict:
  """GB/s of np.copyto over an `mb` MB float32 buffer, counting read + write."""
  import numpy as np
  n = mb * (1 << 20) // 4
  src, dst = np.ones(n, np.float32), np.zeros(n, np.float32)

  def timed(k):
    parts = np.array_split(np.arange(n), k)
    bounds = [(p[0], p[-1] + 1) for p in parts]
    work = lambda a, b: np.copyto(dst[a:b], src[a:b])
    best = float("inf")
    for _ in range(reps + 1):
      ts = [threading.Thread(target=work, args=ab) for ab in bounds]
      t = time.perf_counter()
      for th in ts:
        th.start()
      for th in ts:
        th.join()
      best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9

  out = {"buffer_mb": mb, "convention": f"GB/s = 2*bytes/s (read + write), best of {reps}",
         "gbps_1_thread": timed(1)}
  if threads > 1:
    out[f"gbps_{threads}_threads"] = timed(threads)
  return out


# ---- ours ---------------------------------------------------------------------

def bench_ours(target, ids: list, max_new: int, repeats: int) -> dict:
  import flexdraft_jax
  B = len(ids)
  run = lambda: flexdraft_jax.generate(target, ids, max_new_tokens=max_new, stop=[],
                                       batch_size=B, mode="ar").stats
  run()  # compile + warm
  secs, steps = [], None
  for _ in range(repeats):
    st = run()
    assert st["new_tokens"] == B * max_new, st
    secs.append(st["decode_seconds"])
    steps = st["steps"]
  dec = statistics.median(secs)
  return {"impl": "flexdraft_jax", "batch": B, "decode_seconds": dec,
          "decode_seconds_all": secs, "steps": steps,
          "tok_per_s": B * steps / dec, "ms_per_step": 1e3 * dec / steps}


# ---- HF -----------------------------------------------------------------------

def bench_hf(model, ids: list, max_new: int, repeats: int, pad_id: int) -> dict:
  import torch
  import transformers

  class StepClock(transformers.StoppingCriteria):
    """Never stops; records when each new token has been appended."""

    def __init__(self):
      self.t = []

    def __call__(self, input_ids, scores, **kwargs):
      self.t.append(time.perf_counter())
      return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

  B, P = len(ids), max(len(x) for x in ids)
  inp = torch.full((B, P), pad_id, dtype=torch.long)
  mask = torch.zeros((B, P), dtype=torch.long)
  for i, x in enumerate(ids):  # left padding
    inp[i, P - len(x):] = torch.tensor(x)
    mask[i, P - len(x):] = 1

  def run(m):
    clock = StepClock()
    t = time.perf_counter()
    with torch.inference_mode():
      out = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=m,
                           min_new_tokens=m, do_sample=False, pad_token_id=pad_id,
                           eos_token_id=None, stopping_criteria=[clock])
    total = time.perf_counter() - t
    assert out.shape == (B, P + m), out.shape
    assert len(clock.t) == m, len(clock.t)
    return clock.t[-1] - clock.t[0], total

  run(max_new)  # warm
  run(1)
  inner, by_diff = [], []
  for _ in range(repeats):
    dec, total = run(max_new)
    _, total1 = run(1)
    inner.append(dec)
    by_diff.append(total - total1)
  dec, steps = statistics.median(inner), max_new - 1
  return {"impl": "hf_transformers", "batch": B, "decode_seconds": dec,
          "decode_seconds_all": inner, "decode_seconds_by_difference": by_diff,
          "steps": steps, "tok_per_s": B * steps / dec, "ms_per_step": 1e3 * dec / steps}


# ---- breakdown of our AR step ---------------------------------------------------

def breakdown(target, B: int, context: int, S: int, iters: int = 16, reps: int = 3) -> dict:
  """ms per AR step of each part, each run `iters` times inside one jitted loop.

  `step`: forward + LM head + argmax as the engine computes it (stacked
  weights and cache, `lax.scan` over layers, blocked attention), without the
  emit/bookkeeping. Parts of it: `layer_matmuls` (norms, the 7 projections
  and SiLU of all layers, indexing the stacked weights as the model does),
  `attention` (cache write + blocked attention of all layers, stacked cache),
  `lm_head` (final norm + tied-embedding logits + argmax), `loop` (one empty
  loop iteration). Counterfactuals (not library code): `layer_matmuls_unstacked`
  (the same math on per-layer weight buffers) and `step_per_layer_buffers`
  (the whole step with per-layer weight and cache buffers, layers unrolled;
  `_full_attn`: unblocked attention over the S cache slots).
  """
  import jax
  import jax.numpy as jnp
  from flexdraft_jax.decoding.state import KV_BLOCK
  from flexdraft_jax.model import attention, transformer

  cfg, params, eps = target.config, target.params, target.config.rms_norm_eps
  n, layers = cfg.num_layers, params["layers"]
  key = jax.random.PRNGKey(0)
  kv_shape = (n, B, cfg.num_kv_heads, S, cfg.head_dim)
  cache = transformer.KVCache(*(0.1 * jax.random.normal(k, kv_shape)
                                for k in jax.random.split(key)))
  pos = jnp.full((B, 1), context, jnp.int32)
  h0 = 0.1 * jax.random.normal(key, (B, 1, cfg.hidden_size))
  q0 = 0.1 * jax.random.normal(key, (B, 1, cfg.num_heads, cfg.head_dim))
  tok0 = jnp.zeros((B,), jnp.int32)
  per_layer = [jax.tree.map(lambda w: jnp.array(w[i]), layers) for i in range(n)]
  top = {k: v for k, v in params.items() if k != "layers"}
  per_layer_cache = tuple(tuple(jnp.array(c[i]) for i in range(n)) for c in cache)

  def looped(body, init, *args):
    f = jax.jit(lambda c, *a: jax.lax.fori_loop(0, iters, lambda i, c: body(c, *a), c),
                donate_argnums=0)
    out = f(jax.tree.map(jnp.copy, init), *args)
    jax.block_until_ready(out)
    best = float("inf")
    for _ in range(reps):
      t = time.perf_counter()
      out = f(out, *args)
      jax.block_until_ready(out)
      best = min(best, time.perf_counter() - t)
    return 1e3 * best / iters

  def next_token(top, h):
    return jnp.argmax(transformer.logits(top, cfg, h)[:, 0], -1).astype(jnp.int32)

  def step(c, params):
    tok, cache = c
    h, _, cache = transformer.forward(params, cfg, cache, tok[:, None], pos,
                                      kv_block=KV_BLOCK)
    return next_token(params, h), cache

  def step_per_layer(kv_block):
    def body(c, per_layer, top):
      tok, (ks, vs) = c
      ks, vs, b = list(ks), list(vs), jnp.arange(B)[:, None]
      h = transformer.embed(top, tok[:, None])
      for i, lp in enumerate(per_layer):
        q, k, v = transformer._project_qkv(
            lp, transformer.rms_norm(h, lp["input_norm"], eps), pos, cfg)
        ks[i] = ks[i].at[b, :, pos].set(k, mode="drop")
        vs[i] = vs[i].at[b, :, pos].set(v, mode="drop")
        o = attention.attend(q, ks[i], vs[i], pos, kv_block=kv_block)
        h = h + o.reshape(B, 1, -1) @ lp["o"]
        h = h + transformer._mlp(lp, transformer.rms_norm(h, lp["post_norm"], eps))
      return next_token(top, h), (tuple(ks), tuple(vs))
    return body

  def dense(lp, h):  # a layer without attention; k/v kept live through sums
    x = transformer.rms_norm(h, lp["input_norm"], eps)
    a = x @ lp["q"] + jnp.sum(x @ lp["k"]) + jnp.sum(x @ lp["v"])
    h = h + a @ lp["o"]
    return h + transformer._mlp(lp, transformer.rms_norm(h, lp["post_norm"], eps))

  def matmuls(h, layers):
    return jax.lax.scan(lambda h, i: (dense(transformer._layer(layers, i), h), None),
                        h, jnp.arange(n))[0]

  def matmuls_unstacked(h, per_layer):
    for lp in per_layer:
      h = dense(lp, h)
    return h

  def attn(c):
    def one(carry, i):
      q, ck, cv = carry
      kv = q[:, :, :cfg.num_kv_heads]
      ck = transformer._write(ck, i, pos, kv)
      cv = transformer._write(cv, i, pos, kv)
      o = attention.attend(q, ck[i], cv[i], pos, kv_block=KV_BLOCK)
      return (q + 1e-3 * o, ck, cv), None
    return jax.lax.scan(one, c, jnp.arange(n))[0]

  def head(h, top):
    return h + 1e-6 * next_token(top, h)[:, None, None].astype(h.dtype)

  return {
      "batch": B, "context": context, "cache_slots": S,
      "step_ms": looped(step, (tok0, cache), params),
      "layer_matmuls_ms": looped(matmuls, h0, layers),
      "attention_ms": looped(attn, (q0, cache.k, cache.v)),
      "lm_head_ms": looped(head, h0, top),
      "loop_ms": looped(lambda c: c + 1, jnp.int32(0)),
      "layer_matmuls_unstacked_ms": looped(matmuls_unstacked, h0, per_layer),
      "step_per_layer_buffers_ms": looped(step_per_layer(KV_BLOCK),
                                          (tok0, per_layer_cache), per_layer, top),
      "step_per_layer_buffers_full_attn_ms": looped(step_per_layer(None),
                                                    (tok0, per_layer_cache), per_layer, top),
  }


# ---- main ---------------------------------------------------------------------

def _table(rows: list) -> str:
  hf = {r["batch"]: r["tok_per_s"] for r in rows if r["impl"] == "hf_transformers"}
  lines = ["| impl | batch | tok/s | ms/step | ratio ours/HF |", "|---|---|---|---|---|"]
  for r in rows:
    ratio = (f"{r['tok_per_s'] / hf[r['batch']]:.2f}"
             if r["impl"] == "flexdraft_jax" and r["batch"] in hf else "")
    lines.append(f"| {r['impl']} | {r['batch']} | {r['tok_per_s']:.1f} | "
                 f"{r['ms_per_step']:.2f} | {ratio} |")
  return "\n".join(lines)


def main(argv):
  del argv
  n = FLAGS.threads
  _set_threads(n)
  import jax
  import numpy as np
  import torch
  torch.set_num_threads(n)
  import flexdraft_jax
  from flexdraft_jax.decoding.state import KV_BLOCK

  batches = [int(b) for b in FLAGS.batch_sizes]
  M = FLAGS.max_new_tokens
  target = flexdraft_jax.load_target("smollm2-135m")
  from flexdraft_jax.training.config import data_root
  questions, source = _questions(FLAGS.data_dir or data_root(), max(batches))
  weight_bytes = sum(int(x.size) * 4 for x in jax.tree.leaves(target.params))
  hf_model = None
  if not FLAGS.skip_hf:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.conftest import hf_llama_from_target
    hf_model = hf_llama_from_target(target)
    hf_model.set_attn_implementation(FLAGS.hf_attn)
    hf_model.generation_config.eos_token_id = None

  load = os.getloadavg()
  print(f"threads={n} (PJRT_NPROC={os.environ['PJRT_NPROC']}, torch "
        f"{torch.get_num_threads()}), load average at start {load}, prompts: {source}",
        flush=True)
  rows, prompt_lens, breakdowns = [], {}, []
  for B in batches:
    ids = prompt_ids(target.tokenizer, questions, B, FLAGS.prompt_len)
    prompt_lens[B] = [len(x) for x in ids]
    rows.append(bench_ours(target, ids, M, FLAGS.repeats))
    print(rows[-1], flush=True)
    if hf_model is not None:
      rows.append(bench_hf(hf_model, ids, M, FLAGS.repeats, target.config.pad_token_id or 0))
      print(rows[-1], flush=True)
    if FLAGS.breakdown:
      ctx = int(np.mean(prompt_lens[B])) + M // 2  # mid-decode, as the engine sizes it:
      S = -(-(max(prompt_lens[B]) + M + 3) // KV_BLOCK) * KV_BLOCK
      breakdowns.append(breakdown(target, B, ctx, S))
      print(breakdowns[-1], flush=True)

  bw = copy_bandwidth(FLAGS.copy_mb, n)
  ours1 = next((r for r in rows if r["impl"] == "flexdraft_jax" and r["batch"] == 1), None)
  roof = {"weight_bytes_fp32": weight_bytes, **bw}
  if ours1:
    roof["ours_b1_weight_gbps"] = weight_bytes * 1e3 / ours1["ms_per_step"] / 1e9
  hf1 = next((r for r in rows if r["impl"] == "hf_transformers" and r["batch"] == 1), None)
  if hf1:
    roof["hf_b1_weight_gbps"] = weight_bytes * 1e3 / hf1["ms_per_step"] / 1e9

  print()
  print(f"SmolLM2-135M fp32, greedy, {M} new tokens/row, decode only; prompt lengths "
        + ", ".join(f"B={b}: mean {np.mean(v):.0f} (min {min(v)}, max {max(v)})"
                    for b, v in prompt_lens.items()))
  print(_table(rows))
  print()
  print(f"weights streamed per step: {weight_bytes / 1e6:.1f} MB (fp32, tied embedding once)")
  for k in ("ours_b1_weight_gbps", "hf_b1_weight_gbps"):
    if k in roof:
      print(f"  {k}: {roof[k]:.2f} GB/s")
  print(f"memory copy bandwidth (np.copyto {FLAGS.copy_mb} MB, read+write counted): "
        f"{bw['gbps_1_thread']:.2f} GB/s on 1 thread"
        + (f", {bw[f'gbps_{n}_threads']:.2f} GB/s on {n}" if n > 1 else ""))
  for b in breakdowns:
    print("breakdown (ms/step):", {k: (round(v, 3) if isinstance(v, float) else v)
                                  for k, v in b.items()})
  load_end = os.getloadavg()
  print(f"load average at end {load_end}")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"model": "smollm2-135m", "max_new_tokens": M, "threads": n,
                 "hf_attn": FLAGS.hf_attn, "prompt_source": source,
                 "prompt_lens": prompt_lens, "load_average": [load, load_end],
                 "jax": jax.__version__, "torch": torch.__version__,
                 "results": rows, "roofline": roof, "breakdown": breakdowns}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
