"""AR, flex and fixed (mode, k) decoding timed in alternation, per batch size.

  python launch/bench_modes.py --batch_sizes=1,2,4,8,16 \\
      --fixed=parallel:2,parallel:4,parallel:8,sequential:2,sequential:4,sequential:8 \\
      --max_new_tokens=64 --repeats=3 --out_json=runs/bench_modes.json \\
      --out_md=runs/bench_modes.md

Each batch size B decodes the first --batches·B GSM8K test questions (chat
template, greedy, stops off), B at a time, with AR, flex and every --fixed
setting in turn, --repeats timed rounds after one that compiles; the tables give
decode-only tokens/s (median) and × AR with end-to-end (prefill included) × AR
next to it, τ per setting, flex's chosen (mode, k) steps and the × AR its cost
model predicted against what each fixed setting measured, and whether every
output is the target's own (flexdraft_jax/evaluation/modes_bench.py). Flex
times its step costs afresh in each run (memory only). `--drafter=` (empty)
uses a randomly initialised drafter: a smoke run, its numbers mean nothing.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app
from absl import flags

flags.DEFINE_string("target", "smollm2-135m", "target model (a load_target spec)")
flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8",
                    "drafter directory; empty: a random drafter (smoke runs)")
flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16"], "batch sizes")
flags.DEFINE_list("fixed", ["parallel:2", "parallel:4", "parallel:8", "sequential:2",
                            "sequential:4", "sequential:8"],
                  "fixed MODE:K[:DRAFT_DTYPE] settings timed next to AR and flex")
flags.DEFINE_list("flex_trees", [], "draft-tree budgets N: a flex setting with "
                  "speculation.tree_budget=N each (\"flex+tree:N\"); --fixed takes "
                  "tree:N for sequential steps verifying trees of N nodes")
flags.DEFINE_integer("max_new_tokens", 64, "new tokens per row (stops off)", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "sampling temperature (T > 0: each round samples "
                   "with its own seed, and outputs are not compared with AR's)", lower_bound=0.0)
flags.DEFINE_enum("draft_sampling", "auto", ["auto", "on", "off"], "T > 0: sampled or "
                  "argmax drafts (auto: sampled, argmax with draft trees)")
flags.DEFINE_enum("dataset", "gsm8k", ["gsm8k", "mt_bench", "humaneval", "mbpp", "math500"],
                  "the prompts (multi-turn sets: their first turns)")
flags.DEFINE_integer("repeats", 3, "timed rounds per batch size", lower_bound=1)
flags.DEFINE_integer("batches", 1, "batches per batch size B: the first batches·B "
                     "questions, B at a time", lower_bound=1)
flags.DEFINE_string("data_dir", "", "benchmark files (default: $FLEXDRAFT_DATA or "
                    "../shared/data)")
flags.DEFINE_enum("attn_impl", "xla", ["xla", "pallas", "auto"], "attention "
                  "implementation (auto: pallas on GPU/TPU)")
flags.DEFINE_string("out_json", "", "write the results as JSON here")
flags.DEFINE_string("out_md", "", "write the markdown tables here")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import modes_bench
  from flexdraft_jax.paths import data_root
  target = fd.load_target(FLAGS.target, layout="layers")
  drafter, note = modes_bench.load_drafter(FLAGS.drafter, target)
  if note:
    print(f"NOTE: {note}", flush=True)
  sizes = [int(b) for b in FLAGS.batch_sizes]
  settings, dropped = modes_bench.fit_settings(
      modes_bench.default_settings(modes_bench.parse_fixed(FLAGS.fixed),
                                   flex_trees=[int(n) for n in FLAGS.flex_trees]),
      drafter.config.block_size)
  if dropped:
    print(f"NOTE: {', '.join(dropped)} left out: k beyond the drafter's block size "
          f"{drafter.config.block_size}", flush=True)
  prompts = modes_bench.gsm8k_prompts(target, FLAGS.data_dir or data_root(),
                                      max(sizes) * FLAGS.batches, FLAGS.dataset)
  def write(result):  # after each batch size too: a stopped run keeps what it timed
    result.update(dataset=FLAGS.dataset, target=FLAGS.target, drafter=FLAGS.drafter or "random",
                  note=note)
    md = modes_bench.markdown(result)
    for path, text in ((FLAGS.out_json, json.dumps(result, indent=1)), (FLAGS.out_md, md)):
      if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
          f.write(text)
        os.replace(path + ".tmp", path)
    return md

  result = modes_bench.run(target, drafter, prompts, batch_sizes=sizes, settings=settings,
                           max_new_tokens=FLAGS.max_new_tokens, repeats=FLAGS.repeats,
                           batches=FLAGS.batches, attn_impl=FLAGS.attn_impl,
                           temperature=FLAGS.temperature,
                           draft_sampling={"auto": None, "on": True,
                                           "off": False}[FLAGS.draft_sampling],
                           on_batch=write)
  print(write(result), flush=True)
  return 0 if all(r.get("lossless", True) is not False for r in result["results"]) else 1


if __name__ == "__main__":
  sys.exit(app.run(main))
