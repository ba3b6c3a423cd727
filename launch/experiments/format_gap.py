"""Where a drafter's benchmark gap comes from: the answers' format or memorization.

Run (from the repository root):
  PYTHONPATH=. python launch/experiments/format_gap.py \\
    --drafters=flexdraft_jax/drafters/smollm2_135m_L8 --source=gsm8k --limit=64

Scores drafters (walk τ, uniform τ, slot accuracy: `training.offline_tau.score`,
first `--max_new_tokens` answer tokens) on four slices of the training data of one
source: answers to the mix's own prompts the drafter trained on, answers to the
benchmark-instruction variant (`#bench`) it trained on, and the held-out
questions' answers (the trainer's split) in both formats. Trained-on vs held-out
is memorization; own vs `#bench` is the format. Next to `python -m flexdraft_jax
offline-tau` on the benchmark's own test prompts (which use the benchmark's
instruction) this says which gap to close.
"""

from __future__ import annotations

from absl import app
from absl import flags
from ml_collections import config_flags

flags.DEFINE_list("drafters", ["flexdraft_jax/drafters/smollm2_135m_L8"], "drafter directories")
flags.DEFINE_integer("limit", 64, "answers per slice")
flags.DEFINE_integer("max_new_tokens", 128, "answer tokens scored per answer")
flags.DEFINE_string("source", "gsm8k", "the training source to slice")
config_flags.DEFINE_config_file(
    "config", "configs/smollm2_135m.py",
    "the training config: its data (packed, regen_dir) and train.num_eval")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import flexdraft_jax as fd
  from flexdraft_jax.evaluation import plan
  from flexdraft_jax.training import data, offline_tau, regen_store
  config = FLAGS.config
  regen_store.use_packed(config.data)
  target = fd.load_target(config.target)
  parts = data.format_slices(regen_store.load_records(config.data.regen_dir), FLAGS.source,
                             config.train.num_eval, FLAGS.limit)
  n = FLAGS.max_new_tokens
  print(offline_tau.table_header("drafter", "slice", "answers"), flush=True)
  for path in FLAGS.drafters:
    drafter = fd.load_drafter(plan.resolve_path(path), target)
    for name, rs in parts.items():
      if not rs:
        print(f"| {path} | {FLAGS.source} {name} | 0 | | | | | | | |", flush=True)
        continue
      r = offline_tau.score(target, drafter, [list(x.prompt_ids) for x in rs],
                            [list(x.answer_ids[:n]) for x in rs], n)
      print(offline_tau.table_row(path, f"{FLAGS.source} {name}", len(rs), r), flush=True)


if __name__ == "__main__":
  app.run(main)
