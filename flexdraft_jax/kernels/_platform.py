"""Backend selection, compiler parameters and interpret modes.

The platform programs are built for is the default backend's, or the one
`building_for` names: ahead-of-time compiling (`python -m flexdraft_jax aot`)
traces the kernels for a TPU on a host that has none."""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax

from flexdraft_jax.kernels import _common as C

BACKENDS = ("tpu", "gpu")

_BUILDING_FOR = contextvars.ContextVar("flexdraft_building_for", default=None)


def platform() -> str:
  """The platform traced programs are for: "cpu", "tpu" or "gpu" (the
  default backend's, unless inside `building_for`)."""
  return _BUILDING_FOR.get() or jax.default_backend()


@contextlib.contextmanager
def building_for(name: str):
  """Traces inside build programs for platform `name` ("tpu", "gpu"): the
  attention kernels compile for it (no interpreter), `attn_impl="auto"` picks
  Pallas, and the CPU matmul kernel is left out. JAX's trace caches are
  cleared on the way in and out: they know nothing of the platform, so a
  program traced for one would be reused for the other."""
  token = _BUILDING_FOR.set(name)
  jax.clear_caches()
  try:
    yield
  finally:
    _BUILDING_FOR.reset(token)
    jax.clear_caches()


def cost_estimate(flops: float, transcendentals: float, arrays):
  """A `pl.CostEstimate` for one Pallas call (what XLA's cost analysis and
  scheduler see of it): its matmul flops, exponentials, and the bytes of its
  inputs and outputs (`arrays`: anything with shape and dtype)."""
  from jax.experimental import pallas as pl
  nbytes = sum(math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize for x in arrays)
  return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                         bytes_accessed=int(nbytes))


def resolve_backend(backend: str) -> str:
  """"auto" -> the kernel family for `platform()`.

  On CPU (no Pallas compiler) "auto" picks the gpu-structured kernels, which
  the generic Pallas interpreter runs fastest.
  """
  if backend == "auto":
    return "tpu" if platform() == "tpu" else "gpu"
  if backend not in BACKENDS:
    raise ValueError(f"backend must be auto, tpu or gpu, got {backend!r}")
  return backend


def resolve_interpret(backend: str, interpret) -> bool:
  """None -> interpret iff the running platform cannot compile `backend`."""
  if interpret is None:
    return platform() != backend
  return bool(interpret)


def interpret_arg(cfg: C.Cfg):
  """The `interpret=` value of pallas_call for this configuration."""
  if not cfg.interpret:
    return False
  if cfg.backend == "tpu":
    # TPU interpret mode simulates HBM/VMEM/SMEM, DMAs and semaphores.
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams()
  return True


def compiler_params(cfg: C.Cfg, grid_rank: int):
  if cfg.backend == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    # Every grid axis is independent (each program owns its output block).
    return pltpu.CompilerParams(
        dimension_semantics=("parallel",) * grid_rank)
  from jax.experimental.pallas import triton as plgpu
  warps = 4 if cfg.bq * cfg.bk <= 64 * 64 else 8
  return plgpu.CompilerParams(num_warps=warps, num_stages=2)
