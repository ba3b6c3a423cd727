"""A random tiny target (`random:tiny`, see flexdraft_jax/model/random_target.py) for tests.

  python -m flexdraft_jax regenerate --config configs/tiny_test.py \
      --config.data.regen_dir=runs/tiny_regen
  python -m flexdraft_jax train --config configs/tiny_test.py \
      --config.data.regen_dir=runs/tiny_regen --workdir runs/tiny_run

Other random targets: --config.target=random:tiny-qwen3 (qk-norm, untied head)
or random:tiny-qwen2 (q/k/v biases); an optional :SEED suffix picks the weights.
"""

from flexdraft_jax.training.config import base_config


def get_config():
  c = base_config("tiny_test")
  c.target = "random:tiny"
  c.dtype = "float32"
  c.drafter.num_layers = 2
  c.drafter.block_size = 4
  c.drafter.calib_rank = 16
  c.data.mix = dict(gsm8k=6, mbpp=4, arena_hard_v01=2, arena_hard_v20=0, self_instruct=0)
  # Byte-level prompts: GSM8K/MBPP prompts with their instruction are ~250-500
  # tokens. A prompt must leave room in seq_len for an anchor block and its
  # answer (training refuses data where most sequences have none).
  c.data.max_prompt_tokens = 480
  c.data.max_new_tokens = 12
  c.data.batch_size = 4
  c.train.seq_len = 512
  c.train.batch_size = 8
  c.train.anchors_per_seq = 2
  c.train.lr = 3e-3
  c.train.warmup_steps = 2
  c.train.num_steps = 8
  c.train.log_every = 1
  c.train.eval_every = 4
  c.train.ckpt_every = 2
  c.train.num_eval = 4
  c.train.eval_batch_size = 8
  return c
