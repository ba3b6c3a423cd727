"""One time-boxed benchmark run for a GPU or TPU host: kernels, then decoding modes.

  python launch/accelerator_bench.py --out_dir=runs/accelerator_bench --minutes=8

  1. The Pallas attention kernels against XLA at decode-step shapes
     (flexdraft_jax/evaluation/kernel_bench.py: time, K/V bandwidth, max error),
     for at most --kernel_minutes. On a CPU the kernels run in interpret mode:
     that checks they work, the timings mean nothing.
  2. AR, flex and the --fixed (mode, k) settings in alternation at each batch
     size (flexdraft_jax/evaluation/modes_bench.py), with the Pallas attention
     where the platform compiles it (--attn_impl=auto: GPU/TPU; XLA on a CPU). If
     a Pallas run fails, the error is recorded and the rest runs with XLA.
     The batch sizes share what is left of --minutes; one that would not fit is
     skipped, and a batch size ends its timed rounds early rather than overrun.
  3. OUT_DIR/accelerator_bench.json (everything) and accelerator_bench.md (the
     tables), rewritten after each stage and batch size, so a run cut short
     still leaves what it finished.

Exit status 0 when every output was the target's own and no stage failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

from absl import app
from absl import flags

flags.DEFINE_string("out_dir", None, "(required) where the JSON and markdown go")
flags.DEFINE_float("minutes", 8.0, "the whole run's budget, loading and compiling "
                   "included", lower_bound=0.1)
flags.DEFINE_float("kernel_minutes", 1.5, "at most this long for the kernel timings "
                   "(0: skip them)", lower_bound=0.0)
flags.DEFINE_float("reserve_minutes", 0.25, "kept at the end for the last writes",
                   lower_bound=0.0)
flags.DEFINE_string("target", "smollm2-135m", "target model (a load_target spec)")
flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8",
                    "drafter directory; empty: a random drafter (smoke runs)")
flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16"], "batch sizes")
flags.DEFINE_list("fixed", ["parallel:2", "parallel:4", "parallel:8", "sequential:2",
                            "sequential:4", "sequential:8", "tree:16", "tree:64",
                            "tree:256"],
                  "fixed MODE:K settings (k beyond the drafter's block are left out), "
                  "and tree:N (sequential steps verifying draft trees of N nodes)")
flags.DEFINE_list("flex_trees", ["64"], "draft-tree budgets N: a flex setting with "
                  "speculation.tree_budget=N each (\"flex+tree:N\")")
flags.DEFINE_integer("max_new_tokens", 128, "new tokens per row (stops off)", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "timed rounds per batch size", lower_bound=1)
flags.DEFINE_integer("batches", 1, "batches per batch size", lower_bound=1)
flags.DEFINE_string("data_dir", "", "benchmark files (default: $FLEXDRAFT_DATA or "
                    "../shared/data)")
flags.DEFINE_enum("attn_impl", "auto", ["auto", "pallas", "xla"], "decoding attention")
flags.DEFINE_list("kernel_models", ["smollm2_135m", "qwen3_8b"], "head layouts timed")
flags.DEFINE_list("kernel_batches", ["1", "16"], "kernel batch sizes")
flags.DEFINE_list("kernel_groups", ["0", "4", "8", "16"], "mask groups G per sequence")
flags.DEFINE_integer("kernel_cache", 2048, "KV cache slots")
flags.DEFINE_integer("kernel_commit", 300, "committed length (row limits)")
flags.DEFINE_integer("kernel_block", 16, "block size of the kernel shapes")
flags.DEFINE_integer("kernel_iters", None, "timed calls per kernel configuration "
                     "(default 50; 2 in interpret mode)")
FLAGS = flags.FLAGS

NAME = "accelerator_bench"


def _write(out_dir: str, record: dict) -> None:
  from flexdraft_jax.evaluation import kernel_bench, modes_bench
  md = [f"# Accelerator benchmark: {record['device']} ({record['platform']})", ""]
  if record.get("kernels"):
    md += ["## Attention kernels", "", kernel_bench.markdown(record["kernels"])]
  if record.get("modes"):
    m = record["modes"]
    md += [f"## Decoding modes: {m['target']}, drafter {m['drafter']}", ""]
    if m.get("note"):
      md += [f"NOTE: {m['note']}", ""]
    if m.get("left_out"):
      md += [f"Left out (k beyond the drafter's block): {', '.join(m['left_out'])}.", ""]
    md += [modes_bench.markdown(m)]
  if record["errors"]:
    md += ["## Errors", ""] + [f"- {e['stage']}: {e['error']}" for e in record["errors"]]
  with open(os.path.join(out_dir, NAME + ".json"), "w") as f:
    json.dump(record, f, indent=1)
  with open(os.path.join(out_dir, NAME + ".md"), "w") as f:
    f.write("\n".join(md) + "\n")


def _error(record: dict, stage: str, e: BaseException) -> None:
  print(f"{NAME}: {stage} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
  record["errors"].append({"stage": stage, "error": f"{type(e).__name__}: {e}"[:2000]})


def main(argv):
  del argv
  start = time.monotonic()
  deadline = start + 60 * (FLAGS.minutes - FLAGS.reserve_minutes)
  import jax

  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import kernel_bench, modes_bench
  from flexdraft_jax.model.attention import resolve_impl
  from flexdraft_jax.paths import data_root
  out_dir = FLAGS.out_dir
  os.makedirs(out_dir, exist_ok=True)
  record = {"platform": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "devices": len(jax.devices()), "jax": jax.__version__,
            "minutes": FLAGS.minutes, "errors": []}
  print(f"{NAME}: {record['device']} ({record['platform']}), {FLAGS.minutes} min "
        f"-> {out_dir}", flush=True)

  if FLAGS.kernel_minutes > 0:  # 1. kernels
    print(kernel_bench.HEADER, flush=True)
    try:
      record["kernels"] = kernel_bench.run(
          FLAGS.kernel_models, [int(b) for b in FLAGS.kernel_batches],
          [int(g) for g in FLAGS.kernel_groups], cache=FLAGS.kernel_cache,
          commit=FLAGS.kernel_commit, block=FLAGS.kernel_block, iters=FLAGS.kernel_iters,
          deadline=min(deadline, time.monotonic() + 60 * FLAGS.kernel_minutes),
          log=lambda row: print(kernel_bench.format_row(row), flush=True))
    except Exception as e:  # noqa: BLE001 - recorded; the modes still run
      _error(record, "kernels", e)
    _write(out_dir, record)

  try:  # 2. decoding modes
    target = fd.load_target(FLAGS.target, layout="layers")
    drafter, note = modes_bench.load_drafter(FLAGS.drafter, target)
    settings, dropped = modes_bench.fit_settings(
        modes_bench.default_settings(modes_bench.parse_fixed(FLAGS.fixed),
                                     flex_trees=[int(n) for n in FLAGS.flex_trees]),
        drafter.config.block_size)
    sizes = [int(b) for b in FLAGS.batch_sizes]
    prompts = modes_bench.gsm8k_prompts(target, FLAGS.data_dir or data_root(),
                                        max(sizes) * FLAGS.batches)
  except Exception as e:  # noqa: BLE001
    _error(record, "modes setup", e)
    _write(out_dir, record)
    return 1
  impl = resolve_impl(FLAGS.attn_impl)
  meta = dict(target=FLAGS.target, drafter=FLAGS.drafter or "random",
              note=note, left_out=dropped)
  done = []  # batch sizes finished (with any attention implementation)

  def on_batch(result):
    record["modes"] = {**result, **meta, "results": done + result["results"]}
    _write(out_dir, record)

  while True:
    todo = [b for b in sizes if b not in {r["batch_size"] for r in done}]
    try:
      result = modes_bench.run(
          target, drafter, prompts, batch_sizes=todo, settings=settings,
          max_new_tokens=FLAGS.max_new_tokens, repeats=FLAGS.repeats,
          batches=FLAGS.batches, attn_impl=impl, deadline=deadline, on_batch=on_batch)
      done += result["results"]
      record["modes"] = {**result, **meta, "results": done}
      break
    except Exception as e:  # noqa: BLE001
      _error(record, f"modes ({impl})", e)
      if impl != "pallas":
        break
      if record.get("modes"):  # the batch sizes the Pallas run finished stay
        done = list(record["modes"]["results"])
      impl = "xla"
      print(f"{NAME}: the rest runs with XLA attention", flush=True)
  record["wall_seconds"] = time.monotonic() - start
  _write(out_dir, record)
  print(open(os.path.join(out_dir, NAME + ".md")).read(), flush=True)
  rows = record.get("modes", {}).get("results", [])
  ok = rows and all(r.get("lossless", True) for r in rows) and not record["errors"]
  return 0 if ok else 1


if __name__ == "__main__":
  flags.mark_flag_as_required("out_dir")
  sys.exit(app.run(main))
