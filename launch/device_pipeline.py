"""The drafter pipeline in one time-boxed run, for a machine with an accelerator.

  PYTHONPATH=. python launch/device_pipeline.py --config=configs/smollm2_135m_L8_gpu.py \
      --out=runs/pipeline --minutes=9 [--regen_minutes=2] [--config.train.X=...]

Each stage runs in this process and writes under --out as it ends, so a run cut
short still leaves what it finished:

  1. regenerate (--regen_minutes > 0): the target answers the prompts of the
     mix the dataset does not hold yet, `data.batch_size` at a time (a large
     batch: one compiled decode loop), and `regen.npz` packs the whole dataset
     (token ids in uint16) when it grew.
  2. train, for what is left of --minutes less --reserve_minutes:
     `train.max_minutes` ends it on time (a last eval, checkpoint and exports in
     OUT/run: metrics.csv, best_drafter/, final_drafter/). --probe first times
     the step on a random target of the same shapes and sets `train.num_steps`
     (and the cool-down, `train.decay_steps` = --decay_fraction of it) to the
     steps that fit, so the rate falls to 0 as the time runs out.
  3. the learning curve of the run (`python -m flexdraft_jax learning-curve`:
     curve.png, curve.md).
  4. drafter.tar.xz (--archive): best_drafter/ in one compressed file, and
     summary.json: what each stage took, mask rows/s, held-out τ.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "(required) where the stages write; made if missing")
flags.DEFINE_float("minutes", 9.0, "the whole run's budget, target load and compiles "
                   "included", lower_bound=0.5)
flags.DEFINE_float("regen_minutes", 0.0, "regenerate for at most this long first "
                   "(0: the dataset as it is)", lower_bound=0.0)
flags.DEFINE_float("reserve_minutes", 0.75, "kept after training for the last eval, the "
                   "exports, the curve and the archive", lower_bound=0.0)
flags.DEFINE_bool("probe", False, "time the train step on a random target of the "
                  "same shapes first and fit num_steps to the budget")
flags.DEFINE_integer("probe_steps", 5, "timed steps of the probe", lower_bound=1)
flags.DEFINE_string("probe_target", "", "the probe's random target (random:NAME); "
                    "default: the one with the target's shapes (a target load more)")
flags.DEFINE_float("decay_fraction", 0.3, "with --probe: the share of the fitted "
                   "steps that cool down (constant schedule)", lower_bound=0.0,
                   upper_bound=0.9)
flags.DEFINE_bool("archive", True, "write OUT/drafter.tar.xz of the best drafter")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _log(msg: str) -> None:
  print(f"pipeline: {msg}", flush=True)


def probe_step_seconds(config, steps: int, target: str = "") -> tuple:
  """(seconds a train step takes, seconds the setup and compile took) on a random
  target (`target`, else the one of the config target's shapes), with the
  config's batch."""
  import jax

  from flexdraft_jax.model import loading
  from flexdraft_jax.training import sharding, train
  if not target:
    target = "random:" + _random_name(loading.load_target(config.target,
                                                          config.dtype).config)
  probe = config.copy_and_resolve_references()
  with probe.unlocked():
    probe.train.init_from = ""
    probe.train.eval_every = 0
    probe.target = target
  t0 = time.perf_counter()
  su = train.setup(probe, None)
  state, target_params, packer, (train_step, _), mesh = (
      su.state, su.target_params, su.packers.train, su.steps, su.mesh)
  rows = sharding.local_rows(probe.train.batch_size)

  def one(step):
    nonlocal state
    batch = sharding.put_batch(packer.train_batch(step, probe.train.batch_size, rows),
                               mesh, probe.train.batch_size)
    state, m = train_step(state, target_params, batch)
    jax.block_until_ready(m)

  one(0)
  setup = time.perf_counter() - t0
  t0 = time.perf_counter()
  for s in range(1, steps + 1):
    one(s)
  return (time.perf_counter() - t0) / steps, setup


def _random_name(shape) -> str:
  """The random target whose shapes are `shape`'s (model/random_target.py)."""
  from flexdraft_jax.model import random_target
  import dataclasses
  keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "qk_norm", "attention_bias", "tie_embeddings")
  want = {k: getattr(shape, k) for k in keys}
  for name, cfg in random_target.RANDOM_CONFIGS.items():
    if {k: v for k, v in dataclasses.asdict(cfg).items() if k in keys} == want:
      return name
  raise SystemExit(f"--probe: no random target has the shapes of {want}")


def main(argv):
  from flexdraft_jax import cli_util
  from flexdraft_jax.model.config import FlexDraftError
  if len(argv) > 1:
    raise FlexDraftError(f"unexpected arguments: {' '.join(argv[1:])}")
  if not FLAGS.out:
    raise FlexDraftError("--out is required")
  t_start = time.perf_counter()
  elapsed = lambda: time.perf_counter() - t_start
  out = cli_util.writable_dir(FLAGS.out, "--out")
  config = cli_util.load_config("configs/smollm2_135m_L8_gpu.py")
  summary = {"config": config.name, "target": config.target, "stages": {}}

  def stage_done(name, t0, **info):
    summary["stages"][name] = dict(seconds=round(time.perf_counter() - t0, 1), **info)
    with open(os.path.join(out, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)

  import jax
  summary["device"] = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
  summary["jax"] = jax.__version__
  _log(f"{summary['device']}, jax {jax.__version__}; budget {FLAGS.minutes} min")

  if FLAGS.regen_minutes:
    from flexdraft_jax.training import regen_store, regenerate
    t0 = time.perf_counter()
    before = len(regen_store.read_shards(config.data.regen_dir)) if os.path.isdir(
        config.data.regen_dir) else 0
    with config.unlocked():
      config.data.regen_dir = os.path.abspath(config.data.regen_dir)
    meta = regenerate.regenerate(config, max_minutes=FLAGS.regen_minutes)
    added = meta["records"] - before
    info = {"records": meta["records"], "new_tokens": meta["last_run_new_tokens"],
            "tokens_per_s": meta["last_run_tokens_per_s"],
            "batch_size": config.data.batch_size}
    if meta["last_run_new_tokens"]:
      info["packed"] = regen_store.pack_regen(config.data.regen_dir,
                                       os.path.join(out, "regen.npz"))
    stage_done("regenerate", t0, **info)
    _log(f"regenerate: {added} records added ({info['tokens_per_s']} tok/s)")

  if FLAGS.probe:
    t0 = time.perf_counter()
    step_s, setup_s = probe_step_seconds(config, FLAGS.probe_steps, FLAGS.probe_target)
    # What the real run spends before its first step is about the probe's setup;
    # its evals add about one step each.
    left = 60 * (FLAGS.minutes - FLAGS.reserve_minutes) - elapsed() - 2 * setup_s
    tc = config.train
    evals = 1 + (max(left, 0) / step_s) / max(tc.eval_every, 1)
    steps = max(int(left / step_s - 3 * evals), tc.warmup_steps + 2)
    with config.unlocked():
      tc.num_steps = steps  # a cosine schedule anneals over them
      if tc.schedule == "constant":
        tc.decay_steps = min(int(FLAGS.decay_fraction * steps), steps - tc.warmup_steps)
    stage_done("probe", t0, seconds_per_step=round(step_s, 4),
               setup_seconds=round(setup_s, 1), num_steps=steps,
               decay_steps=tc.get("decay_steps", 0))
    _log(f"probe: {step_s:.3f} s a step, {setup_s:.0f} s setup and compile -> "
         f"num_steps={steps}, decay_steps={tc.get('decay_steps', 0)}")

  from flexdraft_jax.training import train
  t0 = time.perf_counter()
  workdir = os.path.join(out, "run")
  with config.unlocked():
    config.train.max_minutes = max((60 * (FLAGS.minutes - FLAGS.reserve_minutes)
                                    - elapsed()) / 60, 0.1)
  _log(f"train: {config.train.max_minutes:.2f} min at most, into {workdir}")
  result = train.train(config, workdir).summary
  rows_per_step = (config.train.batch_size * config.train.anchors_per_seq
                   * config.drafter.block_size)
  seconds = time.perf_counter() - t0
  stage_done("train", t0, steps=result["steps"], mask_rows=result["mask_rows"],
             best_eval_tau=result["best_eval_tau"], best_step=result["best_step"],
             mask_rows_per_s_with_setup=round(result["steps"] * rows_per_step / seconds, 1),
             max_minutes=round(config.train.max_minutes, 2))

  t0 = time.perf_counter()
  metrics = os.path.join(workdir, "metrics.csv")
  curve = subprocess.run(
      [sys.executable, "-m", "flexdraft_jax", "learning-curve", f"--metrics={metrics}",
       f"--out={os.path.join(out, 'curve')}", f"--title={config.name}"],
      capture_output=True, text=True,
      env=dict(os.environ, PYTHONPATH=REPO))
  if curve.returncode:
    _log("learning curve failed: " + (curve.stderr.strip().splitlines() or ["?"])[-1])
  shutil.copy(metrics, os.path.join(out, "metrics.csv"))
  if FLAGS.archive:
    with tarfile.open(os.path.join(out, "drafter.tar.xz"), "w:xz") as tar:
      tar.add(os.path.join(workdir, "best_drafter"), arcname="drafter")
  summary["minutes"] = round(elapsed() / 60, 2)
  stage_done("export", t0, curve=curve.returncode == 0)
  _log(f"done in {summary['minutes']} min: best held-out tau "
       f"{result['best_eval_tau']:.3f} at step {result['best_step']}; {out}")


if __name__ == "__main__":
  from flexdraft_jax.cli_util import define_flags, run_main
  define_flags(sys.argv)
  run_main(main, sys.argv, doc=__doc__,
           key_flags=("config", "out", "minutes", "regen_minutes", "probe"))
