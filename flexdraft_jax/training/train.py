"""`python -m flexdraft_jax train --config configs/X.py --workdir DIR`.

Trains the draft pytree on regenerated data (SPEC §4): only the drafter is
differentiated and has optimizer state; the target pytree is an input of the
jitted step and comes back untouched. Checkpoints (orbax, async, atomic) hold
(step, draft params, optimizer state, their moving average with
train.ema_decay > 0) and resume exactly: batch order and anchors depend only on
(seed, step). WORKDIR gets:

  ckpt/               orbax CheckpointManager
  metrics.csv         per logged step; eval rows carry eval_tau / eval_loss (the
                      held-out answers) and variant_eval_tau / variant_eval_loss
                      (the held-out questions in the prompt variants' formats),
                      with drafter.bonus_dropout also blind_eval_tau / _loss
                      (the held-out answers drafted as parallel mode drafts)
  events.out.tfevents.*  the same scalars for TensorBoard
  best_drafter/       save_drafter export of the checkpoint with the best eval τ
  final_drafter/      the last step's drafter

The pieces live beside it: `steps` (the state and the jitted steps),
`kv_cache` (the clean K/V computed once), `checkpoints` (orbax, resuming),
`drafter_init` (the draft vocabulary, warm starts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
import types
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tqdm
from jax.sharding import NamedSharding, PartitionSpec as P

from flexdraft_jax import run_control
from flexdraft_jax.drafter import checkpoint as drafter_ckpt
from flexdraft_jax.drafter.model import (Drafter, DrafterConfig, init_draft_params,
                                         trainable)
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.model import loading, pytree
from flexdraft_jax.training import (checkpoints, data, kv_cache, loss as loss_lib, regen_store,
                                    run_guard, sharding)
from flexdraft_jax.training.config import check_train_config
from flexdraft_jax.training.drafter_init import draft_vocab, warm_start
from flexdraft_jax.training.metrics_log import MetricsLog
from flexdraft_jax.training.steps import (TrainState, make_optimizer, make_steps,
                                          optimizer_variables, scored_params)

class TrainResult(NamedTuple):
  summary: dict      # JSON-able: steps, tokens seen, best eval τ, data
  params: Any        # final draft pytree on the host (fp32)


def drafter_config(config) -> DrafterConfig:
  return DrafterConfig(**dict(config.drafter))


class Packers(NamedTuple):
  """A run's batches: training, and the held-out sets it is scored on."""
  train: data.Packer
  eval: Optional[data.Packer]      # the held-out answers
  variants: Optional[data.Packer]  # the held-out questions in the prompt variants' formats
  blind: Optional[data.Packer]     # the held-out answers drafted blind (bonus_dropout > 0)


class Setup(NamedTuple):
  """What `setup` makes: the sharded initial state, the target's parameters as
  the steps read them, the batches, the jitted steps and what exports need."""
  state: TrainState
  target_params: Any
  packers: Packers
  steps: tuple                     # (train_step, eval_step), jitted
  mesh: Any
  target: Any                      # name, fingerprint and config of the target
  fixed_params: dict               # the draft pytree's untrained leaves (its vocabulary)
  init_mask_rows: int              # mask rows the warm start's source had seen
  counts: dict                     # records: all, train, eval, eval_variant

EVAL_SLOTS = 4  # eval rows log the accuracy of drafting slots 1..EVAL_SLOTS


def _eval_metrics(sums: list) -> dict:
  """Held-out τ, loss and per-slot accuracy from the eval batches' summed counts."""
  total = {k: sum(np.asarray(s[k], np.float64) for s in sums) for k in sums[0]}
  m = loss_lib.finalize(total)
  out = {"eval_tau": float(m["tau"]), "eval_loss": float(m["loss"])}
  acc = np.asarray(m["acc_S"])
  out.update({f"eval_acc_{j}": float(acc[j]) if j < len(acc) else 0.0
              for j in range(1, EVAL_SLOTS + 1)})
  return out


def setup(config, workdir=None) -> Setup:
  """Target, data, mesh, initial state and jitted steps."""
  tc = config.train
  dcfg = drafter_config(config)
  if tc.seq_len < dcfg.block_size + 2:
    raise FlexDraftError(f"seq_len={tc.seq_len} is too short for block_size="
                         f"{dcfg.block_size}")

  # The data's checks come before the (slow) target load.
  regen_store.use_packed(config.data)
  records = regen_store.load_records(config.data.regen_dir)
  num_eval = min(tc.num_eval, len(records) // 5)
  train_recs, eval_recs = data.split_eval(records, num_eval)
  # The held-out questions again, in the prompt variants' (the benchmarks') formats.
  variant_recs = data.held_out_variants(records, num_eval) if tc.eval_variants else []
  data.check_anchors(train_recs, tc.seq_len, dcfg.block_size)
  target = loading.load_target(config.target, config.dtype)
  regen_store.check_made_by(config.data.regen_dir, target)
  cfg = target.config
  dcfg.validate(cfg)
  pack = functools.partial(data.Packer, seq_len=tc.seq_len, block_size=dcfg.block_size,
                           pad_id=cfg.pad_token_id, seed=tc.seed,
                           width_multiple=tc.width_multiple)
  eval_pack = functools.partial(pack, anchors=tc.eval_anchors or tc.anchors_per_seq)
  packers = Packers(pack(train_recs, anchors=tc.anchors_per_seq,
                  source_weights=dict(config.data.source_weights),
                  variant_weights=dict(config.data.variant_weights),
                  bonus_dropout=dcfg.bonus_dropout),
             *(eval_pack(rs) if rs else None for rs in (eval_recs, variant_recs)),
             # a drafter trained blind too is also scored blind (parallel mode)
             eval_pack(eval_recs, bonus_dropout=1.0)
             if eval_recs and dcfg.bonus_dropout else None)

  mesh = sharding.make_mesh(**dict(config.mesh))
  tx, schedule = make_optimizer(tc)
  vocab = None
  if dcfg.draft_vocab:
    vocab = draft_vocab(workdir, train_recs, dcfg.draft_vocab, cfg)
  # Every process computes the same initial drafter from the same target.
  draft0 = jax.device_get(init_draft_params(
      target.params, cfg, dcfg, jax.random.PRNGKey(tc.seed), jnp.float32, vocab=vocab))
  init_mask_rows = 0
  if tc.init_from:
    draft0 = warm_start(draft0, drafter_ckpt.load_drafter(tc.init_from, target), cfg,
                        dcfg)
    # The learning curve goes on from the rows the source drafter has seen.
    init_mask_rows = int(drafter_ckpt.read_meta(tc.init_from).get("training", {})
                         .get("mask_rows", 0))
  # The vocabulary is data, not a weight: it stays out of the trained state.
  fixed = {k: v for k, v in draft0.items() if k == "vocab"}
  draft0 = trainable(draft0)
  target_sh = sharding.param_shardings(target.params, mesh)
  target_params = sharding.put_global(jax.device_get(target.params), target_sh)
  params_sh = sharding.param_shardings(draft0, mesh)
  params = sharding.put_global(draft0, params_sh)
  rep = NamedSharding(mesh, P())
  opt_state = jax.jit(tx.init)(optimizer_variables(target_params, params))
  # The average starts at the initial weights, in buffers of its own (the state
  # is donated to the step).
  ema = sharding.put_global(draft0, params_sh) if tc.ema_decay else None
  state_sh = TrainState(rep, params_sh,
                        sharding.state_shardings(opt_state, params_sh, mesh),
                        None if ema is None else params_sh)
  state = jax.device_put(TrainState(jnp.int32(0), params, opt_state, ema), state_sh)
  shardings_ = {"state": state_sh, "target": target_sh, "replicated": rep,
                "batch": sharding.batch_sharding(mesh)}
  if tc.precompute_kv:
    for name, p in zip(("train", "eval", "eval_variants", "eval"), packers):
      if p is not None:
        compute = functools.partial(kv_cache.iter_deep_kv, p, target_params, cfg, dcfg,
                                    tc, rep, name)  # rows -> batches
        kv_dir = tc.deep_kv_dir or (workdir and os.path.join(workdir, "deep_kv"))
        p.deep_kv = kv_cache.cached_deep_kv(kv_dir, name, target.fingerprint, p, dcfg,
                                            compute, dtype=tc.deep_kv_dtype or None)
    # The steps read the deep layers only: their weights as separate arrays,
    # sliced once here rather than in every step.
    target_params = jax.jit(functools.partial(pytree.deep_layers_view,
                                              num_draft_layers=dcfg.num_layers))(
                                                  target_params)
    shardings_["target"] = jax.tree.map(lambda x: x.sharding, target_params)
  steps = make_steps(cfg, dcfg, tx, schedule, tc, shardings_, mesh,
                     jax.device_put(fixed, rep))
  # Keep only what exports need; the params now live in `target_params`.
  ref = types.SimpleNamespace(config=cfg, name=target.name, fingerprint=target.fingerprint)
  counts = {"records": len(records), "train_records": len(train_recs),
            "eval_records": len(eval_recs), "eval_variant_records": len(variant_recs)}
  return Setup(state, target_params, packers, steps, mesh, ref, fixed, init_mask_rows,
               counts)


def _host_drafter(config, state: TrainState, fingerprint: str, fixed=None) -> Drafter:
  params = dict(sharding.to_host(scored_params(state)), **jax.device_get(fixed or {}))
  return Drafter(drafter_config(config), params, fingerprint)


def _compile_ahead(steps, state, target_params, packers, mesh, tc, start):
  """Multi-process: compile before the first collective, then meet — compile
  times differ between processes by more than the collectives' set-up timeout."""
  (train_step, eval_step), (packer, eval_packer, *_) = steps, packers
  first = sharding.put_batch(packer.train_batch(start, tc.batch_size,
                                                sharding.local_rows(tc.batch_size)),
                             mesh, tc.batch_size)
  train_step = train_step.lower(state, target_params, first).compile()
  if eval_packer is not None and tc.eval_every > 0:
    eb = eval_packer.eval_batches(tc.eval_batch_size,
                                  sharding.local_rows(tc.eval_batch_size))[0]
    eval_step = eval_step.lower(scored_params(state), target_params, sharding.put_batch(
        eb, mesh, tc.eval_batch_size)).compile()
  sharding.barrier("flexdraft_train_compiled")
  return train_step, eval_step


def _train_row(m, meta, bs, rate) -> dict:
  return {"loss": float(m["loss"]), "tau": float(m["tau"]), "lr": float(m["lr"]),
          "grad_norm": float(m["grad_norm"]), "tokens_seen": meta["tokens_seen"],
          "steps_per_s": rate, **{f"acc_{j}": float(m["acc_S"][j]) for j in range(1, bs)}}


def train(config, workdir: str) -> TrainResult:
  """Runs (or resumes) training in `workdir`, one run per workdir at a time
  (WORKDIR/flexdraft.lock names it). Ctrl-C or SIGTERM (a scheduler's notice
  before it preempts the job) stops it cleanly: the step in progress is
  finished and saved as a checkpoint, nothing half-written is left, and
  `run_control.Stopped` says where it stopped (rerunning resumes there). A
  loss or weights gone non-finite stop it in one line (FlexDraftError);
  nothing non-finite is ever saved as a checkpoint or a drafter."""
  check_train_config(config)
  t_begin = time.perf_counter()  # train.max_minutes counts from here
  sharding.maybe_initialize_distributed(**dict(config.distributed))
  lock = contextlib.nullcontext()
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    lock = run_control.folder_lock(os.path.abspath(workdir), "train")
  run = {}  # what a stop must close: the checkpoint manager, the log, the step
  with lock:
    try:
      return _train(config, workdir, t_begin, run)
    except KeyboardInterrupt as e:
      raise run_control.stopped(e, _stop_cleanly(run, workdir)) from None
    except FlexDraftError:  # a one-line stop (diverged, a damaged checkpoint): close up
      _stop_cleanly(run, workdir)
      raise


def _stop_cleanly(run: dict, workdir: str) -> str:
  """After Ctrl-C / SIGTERM: the save in flight finished and orbax closed (its
  threads would fail at exit), leftovers of a cut save removed, the log
  closed. Returns where the run stopped."""
  if run.get("bar") is not None:
    run["bar"].close()
  mngr, latest = run.get("mngr"), None
  if mngr is not None:
    with contextlib.suppress(Exception):
      mngr.wait_until_finished()
    with contextlib.suppress(Exception):
      latest = mngr.latest_step()
    with contextlib.suppress(Exception):
      mngr.close()
  checkpoints.remove_cut_saves(workdir)
  if run.get("log") is not None:
    run["log"].close()
  at = (f"at step {run['step']}" if run.get("step") is not None
        else "before its first step")
  ckpt = os.path.join(os.path.abspath(workdir), "ckpt")
  kept = (f"checkpoint {latest} is complete in {ckpt}" if latest
          else "no checkpoint yet (a rerun starts over)")
  return f"train {at}; {kept}"


def _train(config, workdir: str, t_begin: float, run: dict) -> TrainResult:
  tc, bs = config.train, config.drafter.block_size
  is_main = jax.process_index() == 0
  if is_main:
    print(f"train: writing checkpoints, metrics and drafters to {os.path.abspath(workdir)}"
          f"{_other_writes(config, workdir)}", flush=True)
  su = setup(config, workdir)
  state, target_params, packers, steps, mesh = su[:5]
  packer, eval_packer, variant_packer, blind_packer = packers
  target, fixed, info = su.target, su.fixed_params, su.counts
  mngr = run["mngr"] = checkpoints.checkpoint_manager(workdir, tc)
  made_by = {"target": target.name, "target_fingerprint": target.fingerprint,
             "drafter": dataclasses.asdict(drafter_config(config))}
  start, state, meta = checkpoints.restore(mngr, state, made_by)
  end = min(tc.stop_at_step, tc.num_steps) if tc.stop_at_step else tc.num_steps
  columns = (["step", "mask_rows", "loss", "tau", "lr", "grad_norm", "tokens_seen",
              "steps_per_s"] + [f"acc_{j}" for j in range(1, bs)]
             + ["eval_tau", "eval_loss"] + [f"eval_acc_{j}" for j in range(1, EVAL_SLOTS + 1)]
             # with a moving average, eval_* score it and these the trained weights
             + (["raw_eval_tau", "raw_eval_loss"] if state.ema is not None else [])
             + (["variant_eval_tau", "variant_eval_loss"] if variant_packer is not None
                else [])
             + (["blind_eval_tau", "blind_eval_loss"] if blind_packer is not None else []))
  log = run["log"] = MetricsLog(workdir, columns, enabled=is_main, resume_step=start)
  if is_main:
    print(f"train: {sharding.describe(mesh)}; {info['train_records']} train / "
          f"{info['eval_records']} eval sequences (+ {info['eval_variant_records']} "
          f"in the prompt variants' formats); steps {start}..{end}", flush=True)
  record = lambda: {
      "target": target.name, "regen_dir": os.path.abspath(config.data.regen_dir),
      "mix": dict(config.data.mix),
      "source_weights": dict(config.data.source_weights),
      "variant_weights": dict(config.data.variant_weights),
      **info, "steps": int(sharding.scalar(state.step)),
      "tokens_seen": meta["tokens_seen"], "mask_rows": meta["mask_rows"],
      "best_eval_tau": meta["best_tau"],
      "best_step": meta["best_step"], "config": config.name,
      # the scored/exported weights: a moving average (ema_decay > 0) or the trained ones
      "lr": tc.lr, "schedule": tc.schedule,
      "decay_steps": tc.decay_steps, "ema_decay": tc.ema_decay}
  evaluating = eval_packer is not None and tc.eval_every > 0
  if jax.process_count() > 1 and start < end:
    steps = _compile_ahead(steps, state, target_params, packers, mesh, tc, start)
  train_step, eval_step = steps
  rows = sharding.local_rows(tc.batch_size)
  rows_per_step = tc.batch_size * tc.anchors_per_seq * bs  # mask rows, global
  meta.setdefault("mask_rows", su.init_mask_rows + start * rows_per_step)

  if evaluating and start == 0 and tc.init_from:
    # A warm start is measured first: the held-out set may differ from the one
    # the source drafter was scored on (more data moves it), and the run's
    # best drafter must beat its starting point.
    ev = _evaluate(eval_step, scored_params(state), target_params, eval_packer, mesh, tc)
    if blind_packer is not None:
      blind = _evaluate(eval_step, scored_params(state), target_params, blind_packer,
                        mesh, tc)
      ev.update(blind_eval_tau=blind["eval_tau"], blind_eval_loss=blind["eval_loss"])
    meta["best_tau"], meta["best_step"] = _score(ev), 0
    _export(os.path.join(workdir, "best_drafter"), config, state, target, record(),
            is_main, fixed)
    log.write(0, {"mask_rows": meta["mask_rows"], **ev})
    if is_main:
      blind = (f"; blind (parallel mode) {ev['blind_eval_tau']:.3f}"
               if "blind_eval_tau" in ev else "")
      print(f"step 0 (warm start from {tc.init_from}): eval tau {ev['eval_tau']:.3f} "
            f"loss {ev['eval_loss']:.3f}{blind}", flush=True)
  bar = run["bar"] = tqdm.tqdm(total=end, initial=start, disable=not is_main,
                              dynamic_ncols=True)
  run["step"] = start
  t_last, s_last = time.perf_counter(), start
  put = lambda step: sharding.put_batch(packer.train_batch(step, tc.batch_size, rows), mesh,
                                       tc.batch_size)
  batch = put(start) if start < end else None
  deadline = t_begin + 60.0 * tc.max_minutes if tc.max_minutes else None
  # A signal (Ctrl-C, a scheduler's SIGTERM) is held back to the end of the
  # step it comes in: the step is logged and saved, then the run stops there.
  with run_control.held():
    for step in range(start, end):
      state, m = train_step(state, target_params, batch)
      # The step runs asynchronously: assemble the next batch meanwhile (with
      # cached K/V, reads from the memory-mapped cache), then wait for it.
      batch = put(step + 1) if step + 1 < end else None
      m = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), m)
      meta["tokens_seen"] += int(m["tokens"])
      meta["mask_rows"] += rows_per_step
      done, row = step + 1, {}
      # Out of time: this step is the run's last, as if it were num_steps.
      last = done == end or (deadline is not None and run_guard.past(deadline, done, tc.log_every))
      diverged = run_guard.diverged(m)
      eval_now = evaluating and (done % tc.eval_every == 0 or last) and not diverged
      if done % tc.log_every == 0 or last or eval_now or diverged:
        # An eval step off the log cadence logs its training row too.
        now = time.perf_counter()
        row = _train_row(m, meta, bs, (done - s_last) / max(now - t_last, 1e-9))
        row["mask_rows"] = meta["mask_rows"]
        t_last, s_last = now, done
        bar.set_postfix(loss=f"{row['loss']:.3f}", tau=f"{row['tau']:.2f}")
      if diverged:
        log.write(done, row)
        raise run_guard.divergence(diverged, done, mngr, workdir, tc)
      run["step"] = done
      if eval_now:
        ev = _evaluate(eval_step, scored_params(state), target_params, eval_packer, mesh, tc)
        if state.ema is not None:
          raw = _evaluate(eval_step, state.params, target_params, eval_packer, mesh, tc)
          ev.update(raw_eval_tau=raw["eval_tau"], raw_eval_loss=raw["eval_loss"])
        if variant_packer is not None:
          var = _evaluate(eval_step, scored_params(state), target_params, variant_packer,
                          mesh, tc)
          ev.update(variant_eval_tau=var["eval_tau"], variant_eval_loss=var["eval_loss"])
        if blind_packer is not None:
          blind = _evaluate(eval_step, scored_params(state), target_params, blind_packer,
                            mesh, tc)
          ev.update(blind_eval_tau=blind["eval_tau"], blind_eval_loss=blind["eval_loss"])
        row.update(ev)
        if _score(ev) > meta["best_tau"]:
          run_guard.check_finite(state, done, mngr, workdir, tc)
          meta["best_tau"], meta["best_step"] = _score(ev), done
          with run_control.critical():  # not cut between its two renames
            _export(os.path.join(workdir, "best_drafter"), config, state, target,
                    record(), is_main, fixed)
        more = (f"; trained weights {ev['raw_eval_tau']:.3f}" if state.ema is not None
                else "")
        if variant_packer is not None:
          more += f"; prompt variants {ev['variant_eval_tau']:.3f}"
        if blind_packer is not None:
          more += f"; blind (parallel mode) {ev['blind_eval_tau']:.3f}"
        bar.write(f"step {done}: eval tau {ev['eval_tau']:.3f} loss {ev['eval_loss']:.3f} "
                  f"(best {meta['best_tau']:.3f} @ {meta['best_step']}){more}")
      if row:
        log.write(done, row)
      save = lambda: mngr.save(done, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))))
      periodic = done % tc.ckpt_every == 0 or last
      if periodic:
        run_guard.check_finite(state, done, mngr, workdir, tc)
        with run_control.critical():  # a stop then waits for this save to finish
          save()
      # A signal held since the step began (or during its save), or (several
      # processes) orbax's preemption point: every process stops after the
      # same step, saved and in the log.
      stop = run_guard.stop_requested(mngr, done, tc.log_every)
      if stop and not periodic:
        if not row:
          row = _train_row(m, meta, bs, (done - s_last) / max(time.perf_counter() - t_last,
                                                               1e-9))
          log.write(done, dict(row, mask_rows=meta["mask_rows"]))
        run_guard.check_finite(state, done, mngr, workdir, tc)
        save()
      bar.update(1)
      if stop:
        raise run_control.stop(stop)
      if last and done < end:
        bar.write(f"train: stopping at step {done} after train.max_minutes="
                  f"{tc.max_minutes} (rerun to resume)")
        break
  bar.close()
  mngr.wait_until_finished()
  mngr.close()
  log.close()

  final = _host_drafter(config, state, target.fingerprint, fixed)
  summary = record()
  if is_main:
    drafter_ckpt.save_drafter(os.path.join(workdir, "final_drafter"), final, target,
                              training=summary)
    if not evaluating:  # nothing to choose from: best = last
      drafter_ckpt.save_drafter(os.path.join(workdir, "best_drafter"), final, target,
                                training=summary)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
  return TrainResult(summary, final.params)


def _score(ev: dict) -> float:
  """What picks the best drafter: held-out τ; for a drafter trained blind
  too, the mean of its τ with the bonus read and blind."""
  if "blind_eval_tau" in ev:
    return 0.5 * (ev["eval_tau"] + ev["blind_eval_tau"])
  return ev["eval_tau"]


def _other_writes(config, workdir) -> str:
  """Where else training writes: the unpacked data, the clean K/V cache."""
  out = []
  if config.data.packed:
    out.append(f"regenerated data into {os.path.abspath(config.data.regen_dir)} "
               "(--config.data.regen_dir)")
  if config.train.precompute_kv:
    kv_dir = config.train.deep_kv_dir or os.path.join(workdir, "deep_kv")
    out.append(f"the clean K/V cache to {os.path.abspath(kv_dir)} "
               "(--config.train.deep_kv_dir)")
  return "".join(f"; {x}" for x in out)


def _evaluate(eval_step, params, target_params, packer, mesh, tc) -> dict:
  rows = sharding.local_rows(tc.eval_batch_size)
  sums = []
  for b in packer.eval_batches(tc.eval_batch_size, rows):
    m = eval_step(params, target_params, sharding.put_batch(b, mesh, tc.eval_batch_size))
    sums.append({k: np.asarray(v.addressable_data(0)) for k, v in m.items()})
  return _eval_metrics(sums)


def _export(path, config, state, target, record, is_main, fixed=None) -> bool:
  drafter = _host_drafter(config, state, target.fingerprint, fixed)  # every process
  if is_main:
    drafter_ckpt.save_drafter(path, drafter, target, training=record)
  return is_main


def run(argv):
  from flexdraft_jax import cli_util
  from flexdraft_jax.cli_util import define_flags
  define_flags(argv, workdir="where checkpoints, metrics and the exported drafters go")

  def main(args):
    config, workdir = cli_util.config_and_workdir(args, "configs/smollm2_135m.py")
    result = train(config, workdir)
    if jax.process_index() == 0:
      print(json.dumps(result.summary))

  cli_util.run_main(main, argv, doc=__doc__)
