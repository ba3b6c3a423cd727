"""Drafter training (SPEC §4): regenerate data with the target, then train the draft pytree.

  prompt_mix.py  the prompt sources of the mix and their variants
  regen_store.py regenerated answers on disk: shards, the tfds dataset, pack/merge
  data.py        the held-out split, draft vocabulary, anchors, batch packing
  regenerate.py  `python -m flexdraft_jax regenerate`
  loss.py        dual-path training loss and offline metrics (τ, per-slot accuracy)
  train.py       `python -m flexdraft_jax train`: optimizer, loop, checkpoints
  sharding.py    mesh, logical-axis rules, multi-process start-up
  config.py      the shared config shape (configs/*.py fill it in), CLI flags
  metrics_log.py metrics.csv + TensorBoard scalars (tensorboardX, no TensorFlow)
"""
