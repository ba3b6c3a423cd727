"""Offline τ of drafters on the benchmarks' own answers: what online τ will read.

Run (from the repository root):
  PYTHONPATH=. python launch/offline_tau.py \\
    --drafters=flexdraft_jax/drafters/smollm2_135m,flexdraft_jax/drafters/smollm2_135m_L8 \\
    --datasets=gsm8k,humaneval,mbpp --limit=64 --max_new_tokens=128

Training's held-out τ scores answers to the training mix's prompts; the drafter
issue's goal is online τ on benchmark prompts, whose answers differ (the
benchmarks' instructions, other questions) and read lower. This script answers
the first `--limit` prompts of each benchmark greedily with the target (chat
template, `--max_new_tokens`, stops on; cached in `--answers`, so each drafter
after the first costs only its offline pass) and scores every drafter on those
answers with the trainer's own loss code, at every anchor:

  uniform τ  the mean over all anchors (what training's eval reports), and
  walk τ     the τ sequential decoding would read (`loss.walk_tau`: from the
             first anchor each step moves on by its τ) — within 0.02 of the
             online sweep on GSM8K, HumanEval and MBPP (64 prompts each; README,
             "Online τ without decoding"), where the uniform mean reads 0.17–0.32 higher.

Drafters can be compared here in minutes instead of a sweep's half hour.
"""

from __future__ import annotations

import json
import os

from absl import app
from absl import flags
import numpy as np

flags.DEFINE_list("drafters", ["flexdraft_jax/drafters/smollm2_135m_L8"], "drafter directories")
flags.DEFINE_list("datasets", ["gsm8k", "humaneval", "mbpp"], "benchmarks")
flags.DEFINE_integer("limit", 64, "prompts per benchmark (the first ones)")
flags.DEFINE_integer("max_new_tokens", 128, "answer tokens per prompt")
flags.DEFINE_integer("batch_size", 16, "AR batch that answers the prompts")
flags.DEFINE_string("answers", "runs/offline_tau/answers.json", "cache of the target's answers")
flags.DEFINE_string("data_dir", "", "benchmark files (default: ../shared/data or $FLEXDRAFT_DATA)")
FLAGS = flags.FLAGS


def _answers(target, name: str, data_dir: str) -> dict:
  """{"prompts": [...], "answers": [...]} token ids, from the cache or answered now."""
  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import benchmarks
  key = f"{name}/{FLAGS.limit}/{FLAGS.max_new_tokens}/{target.fingerprint}"
  cache = {}
  if os.path.exists(FLAGS.answers):
    with open(FLAGS.answers) as f:
      cache = json.load(f)
  if key in cache:
    return cache[key]
  kw = benchmarks.chat_kwargs(target)
  rows = benchmarks.load_benchmark(name, data_dir, FLAGS.limit)
  prompts = [benchmarks.render(target.tokenizer, benchmarks.messages_for_turn(r, []), kw)
             for r in rows]
  print(f"{name}: answering {len(prompts)} prompts (AR, batch {FLAGS.batch_size})",
        flush=True)
  out = fd.generate(target, prompts, max_new_tokens=FLAGS.max_new_tokens,
                    batch_size=FLAGS.batch_size)
  cache[key] = {"prompts": prompts, "answers": [list(map(int, a)) for a in out.token_ids]}
  os.makedirs(os.path.dirname(FLAGS.answers) or ".", exist_ok=True)
  with open(FLAGS.answers + ".tmp", "w") as f:
    json.dump(cache, f)
  os.replace(FLAGS.answers + ".tmp", FLAGS.answers)
  return cache[key]


def score(target, drafter, prompts: list, answers: list) -> dict:
  """Uniform and walk τ, per-slot accuracy of `drafter` over the answers."""
  import jax
  import jax.numpy as jnp
  from flexdraft_jax.training import loss as loss_lib
  from flexdraft_jax.util import round_up
  cfg, dcfg = target.config, drafter.config
  fn = jax.jit(lambda dp, tp, b: loss_lib.loss_sums(dp, tp, cfg, dcfg, b,
                                                    per_anchor=True)[1])
  K = round_up(FLAGS.max_new_tokens, 16)  # anchors per answer, padded: one shape
  tau_sum = anchors = walk_tokens = walk_steps = 0
  correct = n_slot = 0
  for p, a in zip(prompts, answers):
    if len(a) < 1:
      continue
    toks = list(p) + list(a)
    T = round_up(len(p) + K + dcfg.block_size + 1, 64)
    anchor = np.full((K,), len(p) - 1)
    anchor[:len(a)] = np.arange(len(p) - 1, len(toks) - 1)
    ok = np.arange(K) < len(a)
    batch = {"tokens_BxT": jnp.asarray([toks + [0] * (T - len(toks))], jnp.int32),
             "length_B": jnp.asarray([len(toks)], jnp.int32),
             "anchor_BxK": jnp.asarray(anchor[None], jnp.int32),
             "anchor_ok_BxK": jnp.asarray(ok[None])}
    s = jax.device_get(fn(drafter.params, target.params, batch))
    tau_sum += float(s["tau_sum"])
    anchors += float(s["n_anchor"])
    tokens, steps = loss_lib.walk_tau(s["tau_BxK"][0][:len(a)])
    walk_tokens, walk_steps = walk_tokens + tokens, walk_steps + steps
    correct, n_slot = correct + s["correct_S"], n_slot + s["n_slot_S"]
  acc = correct / np.maximum(n_slot, 1)
  return {"uniform_tau": tau_sum / max(anchors, 1), "walk_tau": walk_tokens / max(walk_steps, 1),
          "acc": [float(x) for x in acc[1:5]], "anchors": int(anchors)}


def main(argv):
  del argv
  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import sweep
  from flexdraft_jax.paths import data_root
  target = fd.load_target("smollm2-135m")
  data_dir = FLAGS.data_dir or data_root()
  sets = {name: _answers(target, name, data_dir) for name in FLAGS.datasets}
  print("| drafter | dataset | prompts | anchors | uniform τ | walk τ | acc 1 | acc 2 | acc 3 "
        "| acc 4 |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
  for path in FLAGS.drafters:
    drafter = fd.load_drafter(sweep.resolve_path(path), target)
    for name, d in sets.items():
      r = score(target, drafter, d["prompts"], d["answers"])
      accs = " | ".join(f"{x:.3f}" for x in r["acc"])
      print(f"| {path} | {name} | {len(d['prompts'])} | {r['anchors']} | "
            f"{r['uniform_tau']:.3f} | {r['walk_tau']:.3f} | {accs} |", flush=True)


if __name__ == "__main__":
  app.run(main)
