"""Backend selection, compiler parameters and interpret modes."""

from __future__ import annotations

import contextlib
import math
import threading

import jax

from flexdraft_jax.kernels import _common as C

BACKENDS = ("tpu", "gpu")

# The platform programs are traced for, where that is not the running one:
# `python -m flexdraft_jax aot` compiles for a TPU or GPU from a CPU host.
_TRACING_FOR = threading.local()


def platform() -> str:
  """The platform the programs being traced now are for ("cpu", "tpu", "gpu"):
  `compiling_for`'s, else `jax.default_backend()`. Every choice a program
  makes by platform at trace time (the Pallas kernel family and interpret
  mode, the CPU matmul kernel, attn_impl="auto") reads this."""
  return getattr(_TRACING_FOR, "platform", None) or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform_name: str):
  """Programs traced inside are for `platform_name` ("tpu", "gpu" or "cuda"),
  not the host's backend (ahead-of-time compiles). Traces are cached by
  JAX per function and shapes, not by this setting: callers clear JAX's
  caches around it (`jax.clear_caches()`)."""
  name = {"cuda": "gpu", "rocm": "gpu"}.get(platform_name, platform_name)
  before = getattr(_TRACING_FOR, "platform", None)
  _TRACING_FOR.platform = name
  try:
    yield
  finally:
    _TRACING_FOR.platform = before


# CostEstimates of the Pallas calls traced while `recording_costs` is on (the
# XLA GPU compiler's cost analysis leaves custom calls, Triton's included, out).
_RECORDED = threading.local()


@contextlib.contextmanager
def recording_costs():
  """Yields a list that collects the CostEstimate of every Pallas call traced inside."""
  before = getattr(_RECORDED, "costs", None)
  _RECORDED.costs = []
  try:
    yield _RECORDED.costs
  finally:
    _RECORDED.costs = before


def cost_estimate(flops: float, transcendentals: float, arrays) -> "object":
  """A `pl.CostEstimate` for one Pallas call (what XLA's cost analysis and
  scheduler see of it): its matmul flops, exponentials, and the bytes of its
  inputs and outputs (`arrays`: anything with shape and dtype)."""
  from jax.experimental import pallas as pl
  nbytes = sum(math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize for x in arrays)
  est = pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                        bytes_accessed=int(nbytes))
  costs = getattr(_RECORDED, "costs", None)
  if costs is not None:
    costs.append(est)
  return est


def resolve_backend(backend: str) -> str:
  """"auto" -> the kernel family for `platform()` (the default backend).

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
