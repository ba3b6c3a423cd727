"""How a training run stops early: its weights went non-finite (one line
naming the last finite checkpoint), a signal or preemption, or the clock.
With several processes, every one stops after the same step."""

from __future__ import annotations

import contextlib
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from flexdraft_jax import run_control
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.training.steps import TrainState


def diverged(m) -> str:
  """What is not finite in a step's metrics ("" when all is well): a loss or
  gradient norm that is NaN or infinite means the update just made has
  spoilt the weights."""
  loss, gnorm = float(m["loss"]), float(m["grad_norm"])
  if np.isfinite(loss) and np.isfinite(gnorm):
    return ""
  return f"loss {loss:g}, grad norm {gnorm:g}"


@jax.jit
def all_finite(tree) -> jax.Array:
  return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def check_finite(state: TrainState, step: int, mngr, workdir: str, tc) -> None:
  """Before weights are kept (a checkpoint, best_drafter): the trained
  weights and their average must be finite, else the run stops in one line."""
  if not bool(all_finite((state.params, state.ema))):
    raise divergence("the weights are no longer finite", step, mngr, workdir, tc)


def divergence(what: str, step: int, mngr, workdir: str, tc) -> FlexDraftError:
  """The one line of a run whose training went non-finite. Nothing
  non-finite is ever saved, so the latest checkpoint is the last finite one."""
  with contextlib.suppress(Exception):
    mngr.wait_until_finished()
  latest = mngr.latest_step()
  ckpt = os.path.join(os.path.abspath(workdir), "ckpt")
  kept = (f"checkpoint {latest} in {ckpt} is the last finite one (a rerun resumes there)"
          if latest else "there is no checkpoint yet (a rerun starts over)")
  return FlexDraftError(f"training diverged at step {step} ({what}); nothing non-finite "
                        f"was saved and {kept}: lower --config.train.lr (now {tc.lr:g}) "
                        "and rerun")


def stop_requested(mngr, step: int, every: int):
  """The signal to stop on after `step` (which is then saved), or None: one
  held back during the step, or orbax's preemption sync point (JAX's
  preemption service, several processes: a SIGTERM on any one stops them
  all after the same step). Several processes agree on a signal one of them
  holds every `every` steps, as `past` does on the clock."""
  import signal
  if mngr.reached_preemption(step):
    return signal.SIGTERM
  if jax.process_count() == 1:
    return run_control.pending()
  if step % every:
    return None
  from jax.experimental import multihost_utils
  held = np.int32(run_control.pending() or 0)
  agreed = int(multihost_utils.process_allgather(held).max())
  return agreed or None


def past(deadline: float, step: int, every: int) -> bool:
  """Whether the clock has passed `deadline`. Several processes must stop at the
  same step (the steps are collectives): they agree on it every `every` steps
  only, so the step loop does not wait on a cross-host gather each step."""
  if jax.process_count() == 1:
    return time.perf_counter() >= deadline
  if step % every:
    return False
  from jax.experimental import multihost_utils
  past = np.int32(time.perf_counter() >= deadline)
  return bool(multihost_utils.process_allgather(past).max())
