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
"""

from __future__ import annotations

import json
import statistics
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
  from flexdraft_jax.evaluation import benchmarks, sweep
  from flexdraft_jax.paths import data_root
  target = fd.load_target("smollm2-135m", layout="layers")
  drafter = fd.load_drafter(sweep.resolve_path(FLAGS.drafter), target)
  kw = benchmarks.chat_kwargs(target)
  sizes = [int(b) for b in FLAGS.batch_sizes]
  rows = benchmarks.load_benchmark("gsm8k", FLAGS.data_dir or data_root(),
                                   max(sizes) * FLAGS.batches)
  results = []
  fixed = {}
  for spec in FLAGS.fixed:
    mode, k, *dtype = spec.split(":")
    fixed[spec] = dict(mode=mode, drafter=drafter, verify_len=int(k),
                       draft_dtype=dtype[0] if dtype else FLAGS.draft_dtypes[0])
  flexes = {("flex" if i == 0 else f"flex:{d}"): dict(
      mode="flex", drafter=drafter, threshold=FLAGS.threshold, draft_dtype=d)
            for i, d in enumerate(FLAGS.draft_dtypes)}
  print("| batch | AR tok/s (median, best) | flex tok/s (median, best) | flex / AR "
        "(median) | best fixed (mode:k, tok/s) | flex / best fixed | flex steps (k) "
        "| outputs equal |", flush=True)
  print("|---|---|---|---|---|---|---|---|", flush=True)
  for b in sizes:
    ids = [benchmarks.render(target.tokenizer, benchmarks.messages_for_turn(p, []), kw)
           for p in rows[:b * FLAGS.batches]]
    opts = {"ar": dict(mode="ar"), **flexes, **fixed}
    tps = {m: [] for m in opts}
    last = {}
    for i in range(FLAGS.repeats + 1):
      for m, o in opts.items():  # generate decodes the prompts b at a time
        res = fd.generate(target, ids, max_new_tokens=FLAGS.max_new_tokens, stop=[],
                          batch_size=b, **o)
        if i:  # the first call of each mode compiles
          tps[m].append(res.stats["tokens_per_second"])
        last[m] = res
    med = {m: statistics.median(v) for m, v in tps.items()}
    steps = _run_lengths(last["flex"].stats["mode_steps"])
    ks = _run_lengths(last["flex"].stats["group_counts"])
    equal = all(last[m].token_ids == last["ar"].token_ids for m in opts)
    best = max(fixed, key=med.get) if fixed else None
    results.append({"batch_size": b, "batches": FLAGS.batches, "tokens_per_second": tps,
                    "median": med, "flex_over_ar": med["flex"] / med["ar"],
                    "flex_mode_steps": steps, "flex_verify_lengths": ks, "best_fixed": best,
                    "tau": {m: last[m].stats["tau"] for m in opts},
                    "step_costs": last["flex"].stats.get("step_costs"),
                    "flex_choices": last["flex"].stats.get("flex_choices"),
                    "outputs_equal": equal})
    best_cols = (f"{best}, {med[best]:.1f} | {med['flex'] / med[best]:.2f}" if best
                 else "- | -")
    print(f"| {b} | {med['ar']:.1f}, {max(tps['ar']):.1f} | {med['flex']:.1f}, "
          f"{max(tps['flex']):.1f} | {med['flex'] / med['ar']:.2f} | {best_cols} | "
          f"{' '.join(f'{m}×{n}' for m, n in steps)} "
          f"({' '.join(f'{k}×{n}' for k, n in ks)}) | {'yes' if equal else 'NO'} |",
          flush=True)
    for m in opts:  # every setting's median and τ, for the A/Bs the table leaves out
      print(f"  {m}: {med[m]:.1f} tok/s, τ {last[m].stats['tau']:.3f}", flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump({"max_new_tokens": FLAGS.max_new_tokens, "repeats": FLAGS.repeats,
                 "results": results}, f, indent=1)
  return 0 if all(r["outputs_equal"] for r in results) else 1


def _run_lengths(log) -> list:
  """A run-length log of [key, steps] (several batches' logs one after another)
  as the total steps of each key, in first-seen order."""
  total = {}
  for key, n in log:
    total[key] = total.get(key, 0) + n
  return [[key, n] for key, n in total.items()]


if __name__ == "__main__":
  sys.exit(app.run(main))
