"""The training run's orbax checkpoints: the manager, resuming (exactly, also
from checkpoints saved before the optimizer ran over both modules, or refused
in one line when the checkpoints were made by another target or drafter
shape), and what a killed save leaves behind."""

from __future__ import annotations

import glob
import os
import shutil

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.training import steps


def remove_cut_saves(workdir: str) -> None:
  """Removes what a save cut short (a killed run) leaves: `N.orbax-checkpoint-tmp*`
  folders under WORKDIR/ckpt. The complete checkpoints stay."""
  if jax.process_index() == 0:
    for tmp in glob.glob(os.path.join(os.path.abspath(workdir), "ckpt",
                                      "*.orbax-checkpoint-tmp*")):
      shutil.rmtree(tmp, ignore_errors=True)


def checkpoint_manager(workdir: str, tc) -> ocp.CheckpointManager:
  remove_cut_saves(workdir)
  options = ocp.CheckpointManagerOptions(
      max_to_keep=tc.max_to_keep, enable_async_checkpointing=True, create=True)
  return ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "ckpt"),
                               options=options)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                     sharding=x.sharding), tree)


# Drafter settings that shape the trained state: a checkpoint made with others
# cannot be resumed.
SHAPE_KEYS = ("num_layers", "block_size", "calib_rank", "calib_tied", "draft_vocab",
              "per_slot_mask", "bonus_input")


def check_same_run(saved: dict, made_by: dict, where: str) -> None:
  """Refuses (one line) to resume checkpoints of another target or drafter
  shape; a changed drafter setting that shapes nothing gets a note."""
  if saved.get("target_fingerprint", made_by["target_fingerprint"]) != \
      made_by["target_fingerprint"]:
    raise FlexDraftError(
        f"{where} holds checkpoints of target {saved.get('target')} (fingerprint "
        f"{saved['target_fingerprint']}), not {made_by['target']} "
        f"({made_by['target_fingerprint']}): use another --workdir")
  old, new = saved.get("drafter") or {}, made_by["drafter"]
  changed = [k for k in old if k in new and old[k] != new[k]]
  shape = [k for k in changed if k in SHAPE_KEYS]
  if shape:
    diff = ", ".join(f"drafter.{k}={old[k]!r} there, {new[k]!r} here" for k in shape)
    raise FlexDraftError(f"{where} holds checkpoints of another drafter shape ({diff}): "
                         "use another --workdir, or the config it was started with")
  if changed and jax.process_index() == 0:
    print("train: note: resuming with " + ", ".join(
        f"drafter.{k}={new[k]!r} (the checkpoints were trained with {old[k]!r})"
        for k in changed), flush=True)


def _restore(mngr, step: int, like) -> tuple:
  """(state, meta) of checkpoint `step`, the state laid out as `like`."""
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(_abstract(like)), meta=ocp.args.JsonRestore()))
  return restored.state, dict(restored.meta)


def _restore_legacy(mngr, step: int, like):
  """(state, meta) of checkpoint `step` saved before the optimizer ran over
  both modules (its state AdamW's over the draft tree alone), that state moved
  into the `multi_transform` layout of `like`; None if it is not one."""
  old = like._replace(opt_state=steps.legacy_opt_state(like.opt_state))
  try:
    state, meta = _restore(mngr, step, old)
  except (ValueError, TypeError, KeyError):
    return None
  if jax.process_index() == 0:
    print(f"train: note: checkpoint {step} predates the optimizer over both modules; "
          "its AdamW state resumes in the new layout", flush=True)
  opt_state = steps.from_legacy_opt_state(state.opt_state, like.opt_state)
  return state._replace(opt_state=opt_state), meta


def restore(mngr, state, made_by: dict):
  """(start step, state, meta) from the latest checkpoint, if any. A run that
  turns the moving average on resumes a checkpoint without one with the
  average started at the restored weights (and one that turns it off drops it).
  A checkpoint saved before the optimizer ran over both modules resumes
  exactly too (`_restore_legacy`). `made_by` (the target and drafter config)
  goes into the checkpoints' meta, and a checkpoint made by others is refused
  in one line."""
  meta = {"tokens_seen": 0, "best_tau": -1.0, "best_step": -1}
  start = mngr.latest_step() or 0
  if start:
    where = f"--workdir {os.path.dirname(os.fspath(mngr.directory))}"
    saved = mngr.restore(start, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    check_same_run(dict(saved.meta), made_by, where)
    had_ema = bool(dict(saved.meta).get("ema", False))
    like = state._replace(ema=state.params if had_ema else None)
    try:
      restored, meta = _restore(mngr, start, like)
    except (ValueError, TypeError, KeyError) as e:  # older checkpoints
      legacy = _restore_legacy(mngr, start, like)
      if legacy is None:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise FlexDraftError(f"{where}: checkpoint {start} does not fit this config "
                             f"({type(e).__name__}: {first}); use another --workdir, or "
                             "the config it was started with") from None
      restored, meta = legacy
    ema = restored.ema
    if state.ema is None:
      ema = None
    elif ema is None:
      ema = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(restored.params)
    state = restored._replace(ema=ema)
  meta["ema"] = state.ema is not None
  meta.update(made_by)
  return start, state, meta
