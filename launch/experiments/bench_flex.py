"""Flex vs AR throughput, SmolLM2-135M + the shipped drafter, the same prompts.

Run (one command, from the repository root):
  PYTHONPATH=. python launch/experiments/bench_flex.py --batch_sizes=1,4,16 --max_new_tokens=64 \\
    --repeats=3 --fixed=sequential:3,sequential:5,sequential:9,sequential:16,parallel:3,parallel:5 \\
    --out=runs/bench_flex.json

The decoding issue's goal is that flex's throughput is never below AR's: where
speculation does not pay, flex must run plain AR steps at AR's speed. A sweep
times each cell once, minutes apart, so on a shared CPU two cells of the same
code differ by ±10 %. Here the two modes alternate (AR, flex, AR, flex, …) on
the same batch — the first `B` GSM8K test questions under the chat template (with
`--batches=N` the first N·B, B at a time, each mode's tokens/s over all N),
greedy, stops off so every row decodes `--max_new_tokens` — after one untimed
call of each, and each mode's tokens/s is the median (and best) of `--repeats`
decode-only timings (the engine's `decode_seconds`). Flex runs with `B* = auto`:
its measured step costs (cached per target/hardware/batch shape), the steps it
ran in each mode and verify length k, and both outputs' equality are reported
too. `--fixed=MODE:K[:DRAFT_DTYPE],…` times fixed (mode, verify length)
settings in the same rotation, so flex can be compared with the best of them;
`--draft_dtypes=auto,target` times flex with each draft dtype (generate's
`draft_dtype`; the first is "flex", the others "flex:DTYPE").
The rotation, the checks and the tables are flexdraft_jax/evaluation/modes_bench.py's
(launch/bench_modes.py runs it with more options).
"""

from __future__ import annotations

import json
import sys

from absl import app
from absl import flags

flags.DEFINE_list("batch_sizes", ["1", "4", "16"], "batch sizes")
flags.DEFINE_integer("max_new_tokens", 64, "new tokens per row (stops off)")
flags.DEFINE_integer("repeats", 5, "timed calls per mode and batch size")
flags.DEFINE_integer("batches", 1, "batches per batch size B: the first batches × B "
                     "questions, B at a time; tokens/s and τ over all of them")
flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8", "drafter directory")
flags.DEFINE_float("threshold", 0.0, "selective verification θ of flex's steps")
flags.DEFINE_list("fixed", [], "fixed MODE:K[:DRAFT_DTYPE] settings to time as well "
                  "(e.g. sequential:5, sequential:8:target)")
flags.DEFINE_list("draft_dtypes", ["auto"], "flex's draft dtypes (generate's draft_dtype)")
flags.DEFINE_string("data_dir", "", "benchmark files (default: ../shared/data or $FLEXDRAFT_DATA)")
flags.DEFINE_string("out", "", "write the results as JSON here")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import modes_bench, plan
  from flexdraft_jax.paths import data_root
  target = fd.load_target("smollm2-135m", layout="layers")
  drafter = fd.load_drafter(plan.resolve_path(FLAGS.drafter), target)
  sizes = [int(b) for b in FLAGS.batch_sizes]
  settings = modes_bench.default_settings(
      modes_bench.parse_fixed(FLAGS.fixed, FLAGS.draft_dtypes[0]), FLAGS.draft_dtypes,
      FLAGS.threshold)
  prompts = modes_bench.gsm8k_prompts(target, FLAGS.data_dir or data_root(),
                                      max(sizes) * FLAGS.batches)
  # "default": flex keeps its timed step costs where generate() keeps them
  result = modes_bench.run(target, drafter, prompts, batch_sizes=sizes, settings=settings,
                           max_new_tokens=FLAGS.max_new_tokens, repeats=FLAGS.repeats,
                           batches=FLAGS.batches, cost_cache="default")
  print(modes_bench.markdown(result), flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=1)
  return 0 if all(r["lossless"] for r in result["results"]) else 1


if __name__ == "__main__":
  sys.exit(app.run(main))
