"""τ of draft trees by node budget, per benchmark, against the chain.

  python launch/bench_trees.py --datasets=gsm8k,humaneval,mt_bench --limit=64 \\
      --budgets=0,8,16,32,64 --batch_size=16 --max_new_tokens=128 \\
      --out_json=runs/tree_tau.json --out_md=runs/tree_tau.md

Each benchmark's first --limit prompts (first turns, chat template) decode with
AR, then in sequential mode with each budget N (0: the chain, the drafter's
whole block; N: draft trees of N nodes, `speculation.tree_budget`). τ counts
emitted tokens per verification. At T = 0 every output is checked against AR's
(token-identical, or diverging only where the target's top-2 logits tie within
1e-5). Untimed: decode at whatever batch size is quickest; τ at T = 0 does not
depend on it (bench_modes.py times the settings, `tree:N` among them).
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app
from absl import flags

flags.DEFINE_string("target", "smollm2-135m", "target model (a load_target spec)")
flags.DEFINE_string("drafter", "flexdraft_jax/drafters/smollm2_135m_L8", "drafter directory")
flags.DEFINE_list("datasets", ["gsm8k", "humaneval", "mt_bench"], "benchmarks")
flags.DEFINE_integer("limit", 64, "first prompts of each benchmark", lower_bound=1)
flags.DEFINE_list("budgets", ["0", "8", "16", "32", "64"],
                  "tree budgets N (0: the chain)")
flags.DEFINE_integer("batch_size", 16, "prompts decoded together", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 128, "new tokens per prompt", lower_bound=1)
flags.DEFINE_float("temperature", 0.0, "sampling temperature (T > 0: no lossless check)")
flags.DEFINE_string("data_dir", "", "benchmark files (default: $FLEXDRAFT_DATA or "
                    "../shared/data)")
flags.DEFINE_string("out_json", "", "write the results as JSON here")
flags.DEFINE_string("out_md", "", "write the markdown table here")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import benchmarks, modes_bench
  from flexdraft_jax.paths import data_root
  budgets = [int(b) for b in FLAGS.budgets]
  target = fd.load_target(FLAGS.target, layout="layers")
  drafter, _ = modes_bench.load_drafter(FLAGS.drafter, target)
  sp = fd.SamplingParams(temperature=FLAGS.temperature)
  kw = benchmarks.chat_kwargs(target)
  result = {"target": FLAGS.target, "drafter": FLAGS.drafter, "limit": FLAGS.limit,
            "max_new_tokens": FLAGS.max_new_tokens, "batch_size": FLAGS.batch_size,
            "temperature": FLAGS.temperature, "budgets": budgets, "datasets": {}}
  for name in FLAGS.datasets:
    rows = benchmarks.load_benchmark(name, FLAGS.data_dir or data_root(), FLAGS.limit)
    ids = [benchmarks.render(target.tokenizer, benchmarks.messages_for_turn(p, []), kw)
           for p in rows]
    run = dict(max_new_tokens=FLAGS.max_new_tokens, sampling=sp, seed=0,
               runtime=fd.RuntimeOptions(batch_size=FLAGS.batch_size))
    ref = fd.generate(target, ids, **run)
    per = {}
    for n in budgets:
      t0 = time.time()
      out = fd.generate(target, ids, drafter=drafter, mode="sequential",
                        speculation=fd.SpecOptions(tree_budget=n or None, cost_cache=None),
                        **run)
      row = {"tau": out.stats["tau"], "accept_hist": out.stats["accept_hist"],
             "seconds": round(time.time() - t0, 1)}
      if FLAGS.temperature == 0:
        row["lossless"], row["lossless_detail"] = modes_bench.check_outputs(
            target, ref.token_ids, [out.token_ids], ids, 1e-5)
      per["chain" if n == 0 else f"tree:{n}"] = row
      print(f"bench_trees: {name} {'chain' if n == 0 else f'tree:{n}'} τ "
            f"{row['tau']:.3f} lossless {row.get('lossless', '-')} ({row['seconds']} s)",
            flush=True)
    result["datasets"][name] = {"prompts": len(ids), "settings": per}
  md = markdown(result)
  print(md, flush=True)
  for path, text in ((FLAGS.out_json, json.dumps(result, indent=1)), (FLAGS.out_md, md)):
    if path:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      with open(path, "w") as f:
        f.write(text)
      print(f"bench_trees: wrote {path}", flush=True)
  return 0 if all(r.get("lossless", True) for d in result["datasets"].values()
                  for r in d["settings"].values()) else 1


def markdown(result: dict) -> str:
  """One row per benchmark, one column per setting: τ (lossless mark at T = 0)."""
  names = ["chain" if n == 0 else f"tree:{n}" for n in result["budgets"]]
  out = [f"τ (emitted tokens per verification), sequential mode, T = "
         f"{result['temperature']:g}, first {result['limit']} prompts, "
         f"{result['max_new_tokens']} new tokens", "",
         "| benchmark | " + " | ".join(names) + " |",
         "|---" * (len(names) + 1) + "|"]
  for ds, d in result["datasets"].items():
    cells = []
    for n in names:
      r = d["settings"][n]
      mark = "" if r.get("lossless", True) else " (NOT lossless)"
      cells.append(f"{r['tau']:.2f}{mark}")
    out.append(f"| {ds} ({d['prompts']}) | " + " | ".join(cells) + " |")
  return "\n".join(out) + "\n"


if __name__ == "__main__":
  sys.exit(app.run(main))
