"""Greedy AR decode tokens/s of flexdraft_jax vs HF transformers, SmolLM2-135M, CPU.

  PYTHONPATH=. python launch/experiments/bench_ar.py --batch_sizes=1,16 --max_new_tokens=128 \\
    --out=runs/bench_ar.json

Per batch size B, both implementations decode the same B GSM8K test prompts
(chat template, greedy, stops off: exactly M = --max_new_tokens tokens a row),
once untimed, then --repeats times (median). Decode time excludes prefill:
  ours: the engine's `decode_seconds` and `tokens_per_second`.
  HF:   `LlamaForCausalLM.generate` (torch fp32, the same dequantized weights,
        flexdraft_jax/model/hf_reference.py); a StoppingCriteria timestamps
        every token, and the first fires after the prefill token, so the
        M - 1 decode forwards lie between the first and last timestamps.
At batch 1 a step streams every weight once, so weight bytes x steps/s is set
against a measured copy bandwidth (np.copyto, read + write counted).

--threads=N pins both to N threads (PJRT_NPROC for XLA:CPU, set before jax is
imported; torch.set_num_threads). Timings on a shared machine are noisy: check
the load averages printed at start and end. launch/experiments/profile_ar_step.py splits
our step into its parts.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("batch_sizes", ["1", "16"], "batch sizes")
flags.DEFINE_integer("max_new_tokens", 128, "new tokens per row (exactly; stops off)")
flags.DEFINE_string("data_dir", "", "benchmark files (default ../shared/data or $FLEXDRAFT_DATA)")
flags.DEFINE_integer("threads", os.cpu_count(), "threads for torch and XLA:CPU")
flags.DEFINE_integer("repeats", 3, "timed calls per configuration (median reported)")
flags.DEFINE_enum("hf_attn", "sdpa", ["sdpa", "eager"], "HF attention implementation")
flags.DEFINE_bool("skip_hf", False, "only time flexdraft_jax")
flags.DEFINE_integer("copy_mb", 256, "buffer size of the memory-bandwidth probe")
flags.DEFINE_string("out", None, "write the results as JSON here")


def copy_bandwidth(mb: int, threads: int, reps: int = 5) -> float:
  """GB/s of np.copyto over an `mb` MB buffer split over `threads`, read + write."""
  import numpy as np
  n = mb * (1 << 20) // 4
  src, dst = np.ones(n, np.float32), np.zeros(n, np.float32)
  bounds = [(p[0], p[-1] + 1) for p in np.array_split(np.arange(n), threads)]
  best = float("inf")
  for _ in range(reps + 1):
    ts = [threading.Thread(target=lambda a, b: np.copyto(dst[a:b], src[a:b]), args=ab)
          for ab in bounds]
    t = time.perf_counter()
    for th in ts:
      th.start()
    for th in ts:
      th.join()
    best = min(best, time.perf_counter() - t)
  return 2 * src.nbytes / best / 1e9


def bench_ours(target, ids: list, max_new: int, repeats: int) -> dict:
  import flexdraft_jax
  run = lambda: flexdraft_jax.generate(
      target, ids, max_new_tokens=max_new, stop=[], mode="ar",
      runtime=flexdraft_jax.RuntimeOptions(batch_size=len(ids))).stats
  run()  # compile + warm
  stats = [run() for _ in range(repeats)]
  for st in stats:
    assert st["new_tokens"] == len(ids) * max_new, st
  mid = sorted(stats, key=lambda st: st["decode_seconds"])[len(stats) // 2]
  return {"impl": "flexdraft_jax", "batch": len(ids), "steps": mid["steps"],
          "decode_seconds_all": [st["decode_seconds"] for st in stats],
          "tok_per_s": mid["tokens_per_second"],
          "ms_per_step": 1e3 * mid["decode_seconds"] / mid["steps"]}


def bench_hf(model, ids: list, max_new: int, repeats: int, pad_id: int) -> dict:
  import torch
  import transformers

  from flexdraft_jax.decoding.timing import tokens_per_second

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

  def run():
    clock = StepClock()
    with torch.inference_mode():
      out = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=max_new,
                           min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id,
                           eos_token_id=None, stopping_criteria=[clock])
    assert out.shape == (B, P + max_new) and len(clock.t) == max_new
    return clock.t[-1] - clock.t[0]

  run()  # warm
  secs = [run() for _ in range(repeats)]
  steps = max_new - 1
  dec = statistics.median(secs)
  return {"impl": "hf_transformers", "batch": B, "steps": steps, "decode_seconds_all": secs,
          "tok_per_s": tokens_per_second(B * steps, dec), "ms_per_step": 1e3 * dec / steps}


def main(argv):
  del argv
  n = FLAGS.threads
  os.environ["PJRT_NPROC"] = str(n)  # before jax is imported
  os.environ.setdefault("OMP_NUM_THREADS", str(n))
  if n == 1:  # XLA:CPU's multi-threaded Eigen dot path off as well
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_multi_thread_eigen=false").strip()
  import jax
  import torch
  torch.set_num_threads(n)
  import flexdraft_jax
  from flexdraft_jax.evaluation import benchmarks
  from flexdraft_jax.paths import data_root

  batches = [int(b) for b in FLAGS.batch_sizes]
  M = FLAGS.max_new_tokens
  target = flexdraft_jax.load_target("smollm2-135m", layout="layers")
  questions = benchmarks.load_benchmark("gsm8k", FLAGS.data_dir or data_root(), max(batches))
  kw = benchmarks.chat_kwargs(target)
  weight_bytes = sum(int(x.size) * 4 for x in jax.tree.leaves(target.params))
  hf_model = None
  if not FLAGS.skip_hf:
    from flexdraft_jax.model.hf_reference import hf_llama_from_target
    hf_model = hf_llama_from_target(flexdraft_jax.load_target("smollm2-135m"))
    hf_model.set_attn_implementation(FLAGS.hf_attn)
    hf_model.generation_config.eos_token_id = None

  load = os.getloadavg()
  print(f"threads={n}, load average at start {load}", flush=True)
  rows = []
  for B in batches:
    ids = [benchmarks.render(target.tokenizer, benchmarks.messages_for_turn(q, []), kw)
           for q in questions[:B]]
    rows.append(bench_ours(target, ids, M, FLAGS.repeats))
    print(rows[-1], flush=True)
    if hf_model is not None:
      rows.append(bench_hf(hf_model, ids, M, FLAGS.repeats, target.config.pad_token_id or 0))
      print(rows[-1], flush=True)

  print(f"\nSmolLM2-135M fp32, greedy, {M} new tokens/row, decode only")
  print("| impl | batch | tok/s | ms/step |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r['impl']} | {r['batch']} | {r['tok_per_s']:.1f} | {r['ms_per_step']:.2f} |")
  roof = {"weight_bytes_fp32": weight_bytes, "copy_gbps": copy_bandwidth(FLAGS.copy_mb, n)}
  for r in rows:
    if r["batch"] == 1:
      roof[f"{r['impl']}_b1_weight_gbps"] = weight_bytes / r["ms_per_step"] / 1e6
  print(json.dumps({k: round(v, 2) for k, v in roof.items()}))
  load_end = os.getloadavg()
  print(f"load average at end {load_end}")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"model": "smollm2-135m", "max_new_tokens": M, "threads": n,
                 "hf_attn": FLAGS.hf_attn, "load_average": [load, load_end],
                 "jax": jax.__version__, "torch": torch.__version__,
                 "results": rows, "roofline": roof}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
