"""The L = 8 SmolLM2-135M drafter's recipe at an accelerator's batch.

  PYTHONPATH=. python launch/device_pipeline.py --config configs/smollm2_135m_L8_gpu.py \
      --out=runs/pipeline --minutes=9

is what an accelerator host runs (README: "Training a drafter"): the recipe of the
CPU line that made flexdraft_jax/drafters/smollm2_135m_L8 (L = 8, the clean pass
inside each step, 64 anchor blocks a sequence, a constant rate with a moving
average, the prompt variants four times an epoch), continued from that drafter,
with 16 times the sequences a step and one compiled width. `train.num_steps`
and `train.decay_steps` are the pipeline's to set from the step time it
measures; `train.max_minutes` ends the run on time whatever they are.
"""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def _cpu_config():
  spec = importlib.util.spec_from_file_location(
      "smollm2_135m_config", os.path.join(HERE, "smollm2_135m.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def get_config():
  c = _cpu_config()
  c.name = "smollm2_135m_L8_gpu"
  c.drafter.num_layers = 8
  # half the blocks train blind, so the drafter keeps drafting in parallel mode
  c.drafter.bonus_dropout = 0.5
  c.train.precompute_kv = False
  c.train.width_multiple = 0      # every batch seq_len wide: one compiled step
  c.train.batch_size = 64         # 64 sequences × 64 anchor blocks × 8 slots = 32,768 mask rows
  c.train.anchors_per_seq = 64
  c.train.init_from = os.path.join(os.path.dirname(HERE), "flexdraft_jax", "drafters",
                                   "smollm2_135m_L8")
  c.train.lr = 5e-4
  c.train.warmup_steps = 50
  c.train.schedule = "constant"
  c.train.num_steps = 2000
  c.train.decay_steps = 600
  c.train.ema_decay = 0.995
  c.train.eval_every = 100
  c.train.ckpt_every = 500
  c.train.log_every = 10
  c.train.eval_batch_size = 32
  for v in ("bench", "fn", "doc"):
    c.data.variant_weights[v] = 4
  return c
