"""The accelerator chips `aot` compiles for: each one's HBM, HBM bandwidth and
peak bf16 FLOP/s as its maker publishes them, and the topology names
(`v5e:2x4`) that pick a slice of them. Plain data: no JAX here."""

from __future__ import annotations

import dataclasses
import math
import re

from flexdraft_jax.model.config import FlexDraftError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  name: str             # as topologies spell it: "v5e"
  device_kind: str      # what JAX's devices of it report
  hbm_bytes: int        # per chip
  hbm_bytes_per_s: float
  peak_bf16_flops: float
  dims: int             # topology dimensions: 2 (v5e 2x4) or 3 (v4 2x2x1)
  accelerator_type: str  # the TPU runtime's name of a slice: .format(chips=, cores=)
  source: str


# Google Cloud's TPU pages, "System architecture" tables (per chip).
CHIPS = {c.name: c for c in (
    Chip("v4", "TPU v4", 32 * GIB, 1200e9, 275e12, 3, "v4-{cores}",
         "https://cloud.google.com/tpu/docs/v4"),
    Chip("v5e", "TPU v5 lite", 16 * GIB, 819e9, 197e12, 2, "v5litepod-{chips}",
         "https://cloud.google.com/tpu/docs/v5e"),
    Chip("v5p", "TPU v5", 95 * GIB, 2765e9, 459e12, 3, "v5p-{cores}",
         "https://cloud.google.com/tpu/docs/v5p"),
    Chip("v6e", "TPU v6 lite", 32 * GIB, 1640e9, 918e12, 2, "v6e-{chips}",
         "https://cloud.google.com/tpu/docs/v6e"),
)}

# The TPU runtime's default chips per host; a smaller slice names its own.
HOST_BOUNDS = (2, 2, 1)


@dataclasses.dataclass(frozen=True)
class Topology:
  name: str     # "v5e:2x4"
  chip: Chip
  shape: tuple  # chips along each axis: (2, 4)

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  def host_bounds(self) -> tuple:
    """`chips_per_host_bounds` for JAX's `get_topology_desc`: the runtime's
    default, shrunk to a slice smaller than one host."""
    shape = tuple(self.shape) + (1,) * (3 - len(self.shape))
    return tuple(b if s % b == 0 else (s if s < b else 1) for s, b in zip(shape, HOST_BOUNDS))

  def accelerator_type(self) -> str:
    return self.chip.accelerator_type.format(chips=self.chips, cores=2 * self.chips)


def parse_topology(text: str) -> Topology:
  """`CHIP:AxB` (v5e, v6e) or `CHIP:AxBxC` (v4, v5p), checked against the chip
  table; a one-line FlexDraftError otherwise."""
  known = ", ".join(CHIPS)
  chip_name, _, shape = str(text).partition(":")
  chip = CHIPS.get(chip_name.strip().lower())
  if chip is None and re.fullmatch(r"[ahb]\d+", chip_name.strip().lower()):
    raise FlexDraftError(f"--topology {text!r}: GPUs are not compiled for yet (TPU slices "
                         f"only: {known})")
  if chip is None:
    raise FlexDraftError(f"--topology {text!r}: unknown chip {chip_name!r} (known: {known}; "
                         "e.g. v5e:2x4, v6e:1x1, v4:2x2x1)")
  example = "x".join(["2"] * chip.dims)
  if not re.fullmatch(r"\d+(x\d+)*", shape.strip()):
    raise FlexDraftError(f"--topology {text!r}: the slice is {chip.dims} numbers joined "
                         f"by x after the chip (e.g. {chip.name}:{example})")
  dims = tuple(int(d) for d in shape.strip().split("x"))
  if len(dims) != chip.dims or min(dims) < 1:
    raise FlexDraftError(f"--topology {text!r}: a {chip.name} slice is {chip.dims} "
                         f"numbers >= 1 joined by x (e.g. {chip.name}:{example})")
  return Topology(f"{chip.name}:{'x'.join(map(str, dims))}", chip, dims)
