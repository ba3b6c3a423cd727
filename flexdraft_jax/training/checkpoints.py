"""The training run's orbax checkpoints: the manager, resuming (exactly, also
from checkpoints saved before the optimizer ran over both modules, or refused
in one line when the checkpoints were made by another target or drafter
shape, or when the latest one is incomplete or damaged), and what a killed
save leaves behind."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sys

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


def _closed_loop_noise(hook):
  """`sys.unraisablehook` that drops the "Event loop is closed" errors of a
  failed orbax restore (tensorstore reads still in flight call back into the
  event loop orbax has closed: dozens of tracebacks after the one real
  error) and passes everything else to `hook`."""
  def filtered(u):
    if isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
      return
    hook(u)
  return filtered


def _quiet_failed_reads() -> None:
  """From now on (the callbacks come late), a failed restore prints no stray
  tracebacks; any other unraisable error still does."""
  if not getattr(sys.unraisablehook, "_flexdraft_quiet", False):
    sys.unraisablehook = _closed_loop_noise(sys.unraisablehook)
    sys.unraisablehook._flexdraft_quiet = True


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
  except Exception:  # pylint: disable=broad-except  # not one (or damaged: the caller says)
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
    _quiet_failed_reads()
    try:
      saved = dict(mngr.restore(start, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore())).meta)
    except Exception as e:  # pylint: disable=broad-except  # its files are not all there
      raise _damaged(mngr, start, state, e, where) from None
    check_same_run(saved, made_by, where)
    like = state._replace(ema=state.params if saved.get("ema", False) else None)
    try:
      restored, meta = _restore(mngr, start, like)
    except Exception as e:  # pylint: disable=broad-except  # older, damaged or another config
      legacy = _restore_legacy(mngr, start, like)
      if legacy is None:
        if _fits(mngr, start, like):
          raise _damaged(mngr, start, state, e, where) from None
        raise FlexDraftError(f"{where}: checkpoint {start} does not fit this config "
                             f"({_first_line(e)}); use another --workdir, or "
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


def _first_line(e: BaseException) -> str:
  line = (str(e).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0]
  return f"{type(e).__name__}: {line[:200]}"


def _shapes(tree) -> list:
  return sorted(tuple(x.shape) for x in jax.tree.leaves(tree))


def _fits(mngr, step: int, like) -> bool:
  """Whether checkpoint `step`'s own record of its arrays (orbax's metadata,
  read without the data) has the shapes of `like` or of its older layout: a
  restore that fails then failed on the data (cut files), not on the config.
  A checkpoint whose record cannot be read is missing files: it fits too."""
  try:
    saved = ocp.StandardCheckpointHandler().metadata(
        mngr.directory / str(step) / "state")
  except Exception:  # pylint: disable=broad-except
    return True
  saved = _shapes(saved.tree if hasattr(saved, "tree") else saved)
  old = like._replace(opt_state=steps.legacy_opt_state(like.opt_state))
  return saved in (_shapes(like), _shapes(old))


def _damaged(mngr, step: int, state, e: BaseException, where: str) -> FlexDraftError:
  """The one line for a latest checkpoint that is incomplete (a partial copy)
  or damaged (cut files): it names the step and the latest earlier checkpoint
  that restores. Nothing is moved or deleted: which copy to trust is the
  user's call, and the damaged one may be all there is of those steps."""
  ckpt = os.fspath(mngr.directory)
  intact = None
  for s in sorted((s for s in mngr.all_steps() if s < step), reverse=True):
    try:
      meta = dict(mngr.restore(s, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore())).meta)
    except Exception:  # pylint: disable=broad-except
      continue
    like = state._replace(ema=state.params if meta.get("ema", False) else None)
    try:
      _restore(mngr, s, like)
    except Exception:  # pylint: disable=broad-except
      with contextlib.redirect_stdout(None):  # its note would speak of a resume
        if _restore_legacy(mngr, s, like) is None:
          continue
    intact = s
    break
  offer = (f"checkpoint {intact} is intact: move {ckpt}/{step} out of {ckpt} to resume "
           f"from step {intact}" if intact is not None else
           "no earlier checkpoint restores either: use another --workdir")
  return FlexDraftError(f"{where}: checkpoint {step} is incomplete or damaged (a partial "
                        f"copy, or cut files: {_first_line(e)}); {offer}")
