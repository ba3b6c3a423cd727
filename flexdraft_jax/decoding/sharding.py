"""The decode batch sharded over every device (data parallel), params replicated."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from flexdraft_jax.util import round_up

_replicated_params = {}


def batch_mesh() -> Optional[Mesh]:
  """A 1-D `data` mesh over all devices, or None on a single device."""
  if jax.device_count() == 1:
    return None
  return Mesh(np.asarray(jax.devices()), ("data",))


def padded_batch(batch: int, mesh: Optional[Mesh]) -> int:
  n = 1 if mesh is None else mesh.size
  return round_up(batch, n)


def cache_sharding(mesh: Optional[Mesh]):
  """Per-layer KV cache arrays `[B, K, S, D]` split on B."""
  return None if mesh is None else NamedSharding(mesh, P("data"))


def put_batch(mesh: Optional[Mesh], *arrays):
  """Host arrays with a leading batch axis, placed split over `data`."""
  if mesh is None:
    return tuple(jax.numpy.asarray(a) for a in arrays)
  return tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in arrays)


def replicate(mesh: Optional[Mesh], tree):
  """`tree` on every device of the mesh (cached per pytree object and mesh)."""
  if mesh is None or tree is None:
    return tree
  key = (id(tree), mesh.devices.shape, tuple(d.id for d in mesh.devices.flat))
  hit = _replicated_params.get(key)
  if hit is None or hit[0] is not tree:
    hit = (tree, jax.device_put(tree, NamedSharding(mesh, P())))
    _replicated_params[key] = hit
  return hit[1]
