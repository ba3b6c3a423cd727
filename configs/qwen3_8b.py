"""Qwen3-8B drafter (L=10, bs=16, r=256) on an accelerator host.

  python -m flexdraft_jax regenerate --config configs/qwen3_8b.py \
      --config.target=/path/to/Qwen3-8B
  python -m flexdraft_jax train --config configs/qwen3_8b.py \
      --config.target=/path/to/Qwen3-8B --workdir runs/qwen3_8b

The target is a Hugging Face checkpoint directory ($FLEXDRAFT_QWEN3_8B, else
the path above). Answers use the chat template with thinking disabled.
Multi-host: add --config.distributed.coordinator=HOST:PORT
--config.distributed.num_processes=N --config.distributed.process_id=I.
"""

from flexdraft_jax.training.config import qwen3_config


def get_config():
  return qwen3_config("qwen3_8b", "FLEXDRAFT_QWEN3_8B", "models/Qwen3-8B", num_layers=10)
