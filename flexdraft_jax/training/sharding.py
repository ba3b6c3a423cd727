"""Mesh, logical-axis sharding rules and multi-process start-up for training.

The mesh has two axes: `data` (batch, data parallel) and `model`. Every
parameter leaf gets logical axis names from its key (LOGICAL_AXES); RULES maps
logical names to mesh axes; anything unnamed, or not divisible by its mesh
axis, is replicated.
"""

from __future__ import annotations

import os
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# logical axis -> mesh axis (None: replicated).
RULES = {"batch": "data", "vocab": "model", "mlp": "model", "heads": "model",
         "kv_heads": "model", "calib": "model", "embed": None, "layers": None,
         "head_dim": None}

# Parameter key -> logical axes of its (stacked) shape.
LOGICAL_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "mask": ("embed",),
    "input_norm": ("layers", "embed"),
    "post_norm": ("layers", "embed"),
    "q": ("layers", "embed", "heads"),
    "k": ("layers", "embed", "kv_heads"),
    "v": ("layers", "embed", "kv_heads"),
    "o": ("layers", "heads", "embed"),
    "q_bias": ("layers", "heads"),
    "k_bias": ("layers", "kv_heads"),
    "v_bias": ("layers", "kv_heads"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "gate": ("layers", "embed", "mlp"),
    "up": ("layers", "embed", "mlp"),
    "down": ("layers", "mlp", "embed"),
    # calibration MLP: w1 [2H, r], b1 [r], w2 [r, V or H], b2 [V or H]
    "w1": (None, "calib"),
    "b1": ("calib",),
    "w2": ("calib", None),
    "b2": (None,),
}


def maybe_initialize_distributed(coordinator: str = "", num_processes: int = 1,
                                 process_id: int = 0) -> None:
  """`jax.distributed.initialize` when asked by arguments or the environment
  (FLEXDRAFT_COORDINATOR / FLEXDRAFT_NUM_PROCESSES / FLEXDRAFT_PROCESS_ID).
  coordinator="auto" lets JAX detect the cluster (TPU pods, SLURM, ...)."""
  env = os.environ
  coordinator = coordinator or env.get("FLEXDRAFT_COORDINATOR", "")
  num_processes = int(env.get("FLEXDRAFT_NUM_PROCESSES", num_processes))
  process_id = int(env.get("FLEXDRAFT_PROCESS_ID", process_id))
  if jax.distributed.is_initialized():
    return
  if coordinator == "auto":
    jax.distributed.initialize()
    return
  if num_processes <= 1 or not coordinator:
    return
  jax.distributed.initialize(coordinator_address=coordinator,
                             num_processes=num_processes, process_id=process_id)


def barrier(name: str, timeout_s: int = 3600) -> None:
  """Waits for every process (no-op with one); needs no compiled collective."""
  if jax.process_count() == 1:
    return
  from jax._src import distributed  # the coordination client has no public barrier
  distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=timeout_s * 1000)


def make_mesh(data: int = -1, model: int = 1) -> Mesh:
  """A (data, model) mesh over all devices; data=-1 takes what model leaves."""
  n = jax.device_count()
  if model < 1 or n % model:
    raise ValueError(f"mesh model={model} does not divide {n} devices")
  if data == -1:
    data = n // model
  if data * model != n:
    raise ValueError(f"mesh data={data} x model={model} != {n} devices")
  devices = np.asarray(jax.devices()).reshape(data, model)
  return Mesh(devices, ("data", "model"))


def spec_for(key: str, shape, mesh: Mesh, rules=None) -> P:
  rules = RULES if rules is None else rules
  names = LOGICAL_AXES.get(key, ())
  if len(names) != len(shape):
    return P()
  axes = []
  for name, dim in zip(names, shape):
    axis = rules.get(name) if name else None
    if axis is not None and (dim % mesh.shape[axis] or axis in axes):
      axis = None
    axes.append(axis)
  return P(*axes)


def param_shardings(tree, mesh: Mesh, rules=None):
  """NamedShardings for a parameter pytree (dicts of arrays), by leaf key."""
  def leaf(path, x):
    key = path[-1].key if path and hasattr(path[-1], "key") else ""
    return NamedSharding(mesh, spec_for(key, x.shape, mesh, rules))
  return jax.tree_util.tree_map_with_path(leaf, tree)


def state_shardings(state, params_shardings, mesh: Mesh):
  """Shardings for a pytree that embeds copies of the param tree (optimizer
  state): a leaf whose trailing dict keys name a param takes its sharding."""
  flat = {}
  for path, s in jax.tree_util.tree_flatten_with_path(params_shardings)[0]:
    flat[tuple(p.key for p in path)] = s
  replicated = NamedSharding(mesh, P())

  def leaf(path, x):
    keys = tuple(p.key for p in path if hasattr(p, "key"))
    for i in range(len(keys)):
      s = flat.get(keys[i:])
      if s is not None and len(s.spec) <= len(getattr(x, "shape", ())):
        return s
    return replicated
  return jax.tree_util.tree_map_with_path(leaf, state)


def put_global(tree, shardings):
  """Host (numpy or process-local) arrays -> global jax Arrays with `shardings`;
  every process must pass the same values (multi-process safe)."""
  def one(x, s):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
  return jax.tree.map(one, tree, shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


def put_batch(local_batch: dict, mesh: Mesh, global_batch: int) -> dict:
  """This process's rows of the batch -> global arrays sharded over `data`."""
  s = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(
      s, np.asarray(v), (global_batch,) + np.asarray(v).shape[1:])
          for k, v in local_batch.items()}


def local_rows(global_batch: int) -> tuple:
  """(start, stop) of this process's rows in a global batch."""
  n, i = jax.process_count(), jax.process_index()
  if global_batch % n:
    raise ValueError(f"batch_size={global_batch} is not divisible by "
                     f"{n} processes")
  per = global_batch // n
  return i * per, (i + 1) * per


def to_host(tree):
  """Global arrays -> numpy on every process (gathers across processes)."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, jax.device_get(tree))
  from jax.experimental import multihost_utils
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def scalar(x) -> float:
  """A replicated scalar as a Python float (multi-process safe)."""
  return float(np.asarray(x.addressable_data(0)))


def describe(mesh: Mesh) -> str:
  return (f"mesh data={mesh.shape['data']} model={mesh.shape['model']} over "
          f"{jax.device_count()} devices, {jax.process_count()} process(es)")
