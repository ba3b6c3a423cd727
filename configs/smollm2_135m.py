"""SmolLM2-135M-Instruct drafter on 2 CPU cores (the embedded default).

  python -m flexdraft_jax regenerate --config configs/smollm2_135m.py
  python -m flexdraft_jax train --config configs/smollm2_135m.py --workdir /work/runs/smollm2

L=4 of 30 layers, bs=16, r=256: a 17 M-parameter drafter (≈ 35 MB in bf16).
Regeneration answers ~800 training prompts with up to 256 new tokens; training
uses short sequences and few anchors so a step takes seconds on a CPU.
"""

import os

from flexdraft_jax.training.config import base_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config():
  c = base_config("smollm2_135m")
  c.target = "smollm2-135m"
  c.dtype = "float32"
  c.drafter.num_layers = 4
  c.drafter.block_size = 16
  c.drafter.calib_rank = 256
  c.data.mix = dict(gsm8k=400, mbpp=200, arena_hard_v01=100, arena_hard_v20=100)
  c.data.max_prompt_tokens = 192
  c.data.max_new_tokens = 256
  c.data.batch_size = 32
  # 2,176 answers (420 k tokens) regenerated at 375ece5, shipped in the repository
  c.data.packed = os.path.join(REPO, "datasets", "smollm2_135m", "regen.npz")
  c.drafter.draft_vocab = 8192   # ≈ 99 % of the answer tokens (SPEC §7)
  c.train.precompute_kv = True   # ~6 GB (memory-mapped) for the 2,112 training answers
  c.train.seq_len = 448
  c.train.batch_size = 8
  c.train.anchors_per_seq = 4
  c.train.num_steps = 2000
  c.train.warmup_steps = 50
  c.train.lr = 1e-3
  c.train.log_every = 10
  c.train.eval_every = 100
  c.train.ckpt_every = 50
  c.train.num_eval = 64
  c.train.eval_anchors = 16
  c.train.eval_batch_size = 8
  return c
