"""The trained state and the jitted training and eval steps (SPEC §4): only
the draft pytree is differentiated and has optimizer state; the target pytree
is an input of the step and comes back untouched.

The optimizer runs over the modules' variables, `{"params": target, "draft":
draft}` (see `optimizer_variables`): a label tree (`param_labels`) sends the
draft's weights to AdamW and the target (and the draft's data leaves) to
`optax.set_to_zero`, so the frozen trunk has no optimizer state and no
update."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from flexdraft_jax.drafter.model import FIXED_KEYS
from flexdraft_jax.training import loss as loss_lib

DECAY_KEYS = ("q", "k", "v", "o", "w1", "w2")
TRAINED, FROZEN = "trained", "frozen"


class TrainState(NamedTuple):
  step: jax.Array
  params: Any        # the draft pytree (fp32 master copy)
  opt_state: Any
  ema: Any = None    # moving average of params (train.ema_decay > 0), else None


def scored_params(state: TrainState):
  """The weights a run scores and exports: the moving average when it keeps one."""
  return state.params if state.ema is None else state.ema


def optimizer_variables(target_params, draft_params) -> dict:
  """What the optimizer runs over: the target as "params", the draft as "draft"."""
  return {"params": target_params, "draft": draft_params}


def param_labels(variables) -> dict:
  """The label tree (a prefix of `variables`): FROZEN for the whole target
  (collection "params") and the draft's data leaves (`FIXED_KEYS`), TRAINED
  for the draft's weights. Being a prefix, it makes the optimizer state hold
  one empty node for the target, whatever its layout."""
  return {"params": FROZEN,
          "draft": {k: FROZEN if k in FIXED_KEYS else TRAINED for k in variables["draft"]}}


def _is_variables(x) -> bool:
  return isinstance(x, dict) and set(x) == {"draft", "params"}


def legacy_opt_state(opt_state):
  """`opt_state` as checkpoints saved before `multi_transform` hold it: the
  TRAINED branch's state (AdamW's chain) over the draft tree alone."""
  inner = opt_state.inner_states[TRAINED].inner_state
  return jax.tree.map(lambda x: x["draft"] if _is_variables(x) else x, inner,
                      is_leaf=_is_variables)


def from_legacy_opt_state(legacy, like):
  """The saved AdamW state `legacy` (`legacy_opt_state`'s layout) placed into
  the TRAINED branch of `like`, an optimizer state of `make_optimizer`'s `tx`
  (the FROZEN branch holds no state)."""
  trained = like.inner_states[TRAINED]
  put = lambda new, old: dict(new, draft=old) if _is_variables(new) else old
  inner = jax.tree.map(put, trained.inner_state, legacy, is_leaf=_is_variables)
  return like._replace(inner_states=dict(
      like.inner_states, **{TRAINED: trained._replace(inner_state=inner)}))


def make_optimizer(tc) -> tuple:
  """AdamW (decay on matrices only) + warm-up, then cosine or constant (with
  an optional linear decay over its last `decay_steps`) + global-norm clipping,
  on the draft's weights only (`param_labels`): `tx` runs over
  `optimizer_variables`."""
  if tc.schedule == "constant":
    schedule = optax.warmup_constant_schedule(0.0, tc.lr, max(tc.warmup_steps, 1))
    decay = tc.decay_steps
    if decay:
      start = tc.num_steps - decay
      schedule = optax.join_schedules(
          [schedule, optax.linear_schedule(schedule(start), 0.0, decay)], [start])
  else:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tc.lr, max(tc.warmup_steps, 1), max(tc.num_steps, tc.warmup_steps + 1),
        end_value=tc.lr * 0.05)
  decay_mask = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key in DECAY_KEYS, p)
  draft_tx = optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                         optax.adamw(schedule, b1=tc.b1, b2=tc.b2,
                                     weight_decay=tc.weight_decay, mask=decay_mask))
  tx = optax.multi_transform({TRAINED: draft_tx, FROZEN: optax.set_to_zero()},
                             param_labels)
  return tx, schedule


def make_steps(cfg, dcfg, tx, schedule, tc, shardings: dict, mesh, fixed=None):
  """Jitted (train_step, eval_step) with explicit shardings; `fixed` holds the
  draft pytree's untrained leaves (the draft vocabulary), closed over.

  With a pure data-parallel mesh (model axis 1) the per-shard work runs under
  `shard_map` and one all-reduce sums gradients and statistics: a single
  collective per step (GSPMD's extra gathers can deadlock emulated CPU
  devices). With a model axis, GSPMD partitions the whole step.
  """
  kw = dict(gamma=tc.gamma, loss_type=tc.loss, attn_impl=tc.attn_impl)
  fixed = fixed or {}

  def grads_and_sums(params, target_params, batch):
    f = lambda p: loss_lib.loss_sums(dict(p, **fixed), target_params, cfg, dcfg,
                                     batch, **kw)
    (_, sums), grads = jax.value_and_grad(f, has_aux=True)(params)
    sums["tokens"] = jnp.sum(batch["length_B"]).astype(jnp.float32)
    return grads, sums

  def eval_sums(params, target_params, batch):
    return loss_lib.loss_sums(dict(params, **fixed), target_params, cfg, dcfg,
                              batch, **kw)[1]

  if mesh.shape["model"] == 1:
    def summed(fn):
      local = lambda *a: jax.lax.psum(fn(*a), "data")
      return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                           out_specs=P(), check_vma=False)
    grads_and_sums, eval_sums = summed(grads_and_sums), summed(eval_sums)

  def train_step(state: TrainState, target_params, batch):
    grads, sums = grads_and_sums(state.params, target_params, batch)
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums["weight"], 1e-9), grads)
    # The target takes no gradient: zeros stand in for it (FROZEN discards
    # them, and XLA drops them, the target's updates being unused).
    updates, opt_state = tx.update(
        optimizer_variables(jax.tree.map(jnp.zeros_like, target_params), grads),
        state.opt_state, optimizer_variables(target_params, state.params))
    params = optax.apply_updates(state.params, updates["draft"])
    ema = state.ema
    if ema is not None:
      ema = jax.tree.map(lambda e, p: e + (1.0 - tc.ema_decay) * (p - e), ema, params)
    m = loss_lib.finalize(sums)
    m.update(grad_norm=optax.tree.norm(grads), lr=schedule(state.step),
             tokens=sums["tokens"])
    return TrainState(state.step + 1, params, opt_state, ema), m

  def eval_step(params, target_params, batch):
    return eval_sums(params, target_params, batch)

  rep = shardings["replicated"]
  train = jax.jit(train_step, donate_argnums=(0,),
                  in_shardings=(shardings["state"], shardings["target"], shardings["batch"]),
                  out_shardings=(shardings["state"], rep))
  evaluate = jax.jit(eval_step, in_shardings=(shardings["state"].params,
                                              shardings["target"], shardings["batch"]),
                     out_shardings=rep)
  return train, evaluate
