"""Evaluation sweep of SmolLM2-135M-Instruct with its shipped drafter.

  python -m flexdraft_jax eval --config configs/eval_smollm2.py --workdir runs/eval_smollm2

A quick look on a CPU (a few minutes):

  python -m flexdraft_jax eval --config configs/eval_smollm2.py --workdir runs/eval_quick \
      --config.eval.datasets=gsm8k,mt_bench --config.eval.limit=2 \
      --config.eval.batch_sizes=1,2 --config.eval.max_new_tokens=32 \
      --config.ablation.enabled=False

Lists are comma-separated strings (--config.eval.batch_sizes=1,4,16). Benchmark
files come from $FLEXDRAFT_DATA, else <repo>/../shared/data (--config.data_dir).
The drafter is flexdraft_jax/drafters/smollm2_135m_L8 (--config.drafter=DIR); until
it exists a random drafter stands in, loudly (--config.random_drafter.allow=False
refuses instead). Ablation drafters with L = 2 and 6 draft layers are the
trainer's exports, made by `bash launch/train_ablation.sh` (the shipped recipe with
--config.drafter.num_layers=N into <runs>/smollm2_135m_LN); a missing one is a
skipped row. L = 4 is the shipped flexdraft_jax/drafters/smollm2_135m. The workdir
is resumable: finished cells are never rerun.
"""

import os

from flexdraft_jax.evaluation.sweep import SHIPPED_DRAFTER, default_config
from flexdraft_jax.paths import runs_root


def get_config():
  c = default_config()
  c.name = "eval_smollm2"
  c.target = "smollm2-135m"
  c.dtype = "float32"
  c.drafter = SHIPPED_DRAFTER
  c.random_drafter.num_layers = 8      # the shipped drafter's shape (configs/smollm2_135m_L8_gpu.py)
  c.random_drafter.block_size = 8
  c.random_drafter.calib_rank = 256
  c.eval.datasets = "gsm8k,math500,humaneval,mbpp,mt_bench"
  c.eval.limit = 16
  c.eval.batch_sizes = "1,4,16"
  c.eval.modes = "ar,parallel,parallel_sel,sequential,flex"
  c.eval.temperatures = "0"
  c.eval.max_new_tokens = 128          # SPEC §6 uses 256; halved for CPU runs
  c.eval.theta = 0.01
  c.ablation.datasets = "gsm8k,mt_bench"
  c.ablation.batch_sizes = "1,4"
  for n in (2, 6):
    c.ablation.layer_drafters[f"L{n}"] = os.path.join(
        runs_root(), f"smollm2_135m_L{n}", "best_drafter")
  c.ablation.layer_drafters.L4 = "flexdraft_jax/drafters/smollm2_135m"
  c.ablation.layer_drafters.L8 = ""    # the main (shipped) drafter has L = 8
  return c
