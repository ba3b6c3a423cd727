"""Qwen3-4B drafter (L=8, bs=16, r=256) on an accelerator host.

  python -m flexdraft_jax regenerate --config configs/qwen3_4b.py \
      --config.target=/path/to/Qwen3-4B
  python -m flexdraft_jax train --config configs/qwen3_4b.py \
      --config.target=/path/to/Qwen3-4B --workdir runs/qwen3_4b

The target is a Hugging Face checkpoint directory ($FLEXDRAFT_QWEN3_4B, else
the path above). Answers use the chat template with thinking disabled.
Multi-host: add --config.distributed.coordinator=HOST:PORT
--config.distributed.num_processes=N --config.distributed.process_id=I.
"""

import os

from flexdraft_jax.training.config import base_config


def get_config():
  c = base_config("qwen3_4b")
  c.target = os.environ.get("FLEXDRAFT_QWEN3_4B", "models/Qwen3-4B")
  c.dtype = "bfloat16"
  c.drafter.num_layers = 8
  c.drafter.block_size = 16
  c.drafter.calib_rank = 256
  c.data.mix = dict(gsm8k=-1, mbpp=-1, arena_hard_v01=-1, arena_hard_v20=-1)
  c.data.chat_kwargs = dict(enable_thinking=False)
  c.data.max_prompt_tokens = 1024
  c.data.max_new_tokens = 1024
  c.data.batch_size = 64
  c.train.seq_len = 2048
  c.train.batch_size = 32
  c.train.anchors_per_seq = 16
  c.train.lr = 6e-4
  c.train.warmup_steps = 500
  c.train.num_steps = 20000
  c.train.log_every = 20
  c.train.eval_every = 1000
  c.train.ckpt_every = 1000
  c.train.num_eval = 128
  c.train.eval_batch_size = 32
  return c
