"""Keeps a long-lived process under Linux's per-process mapping limit.

XLA maps each loaded CPU executable's code and data into the process: a few
hundred mappings for every compiled decode program (about 390 for one mode at
one batch size of a tiny target, measured on a CPU). Linux refuses mappings
past `vm.max_map_count` (65,530 by default), and the next executable XLA loads
then crashes the process. A process that compiles many shapes (a sweep over
batch sizes, a notebook kept open for hours) gets there; `generate` calls
`release_if_near_limit` first, which drops every compiled program once the
process holds over `FRACTION` of the limit. The programs still needed compile
again (or load from JAX's persistent compile cache, where one is set).
"""

from __future__ import annotations

import gc
import logging
from typing import Optional

import jax

log = logging.getLogger(__name__)

FRACTION = 0.75


def count() -> Optional[int]:
  """The mappings this process holds (None where /proc is not Linux's)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
  except OSError:
    return None


def limit() -> Optional[int]:
  """`vm.max_map_count` (None where it cannot be read)."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def release_if_near_limit() -> bool:
  """Drops every compiled program if the process holds over FRACTION of the
  mapping limit; whether it did."""
  n, top = count(), limit()
  if n is None or top is None or n <= FRACTION * top:
    return False
  log.warning("flexdraft_jax: %d memory mappings of at most %d (vm.max_map_count); "
              "dropping compiled programs (they recompile when used again)", n, top)
  release()
  return True


def release() -> None:
  """Drops every compiled program (and frees its mappings)."""
  from flexdraft_jax.decoding import kept_programs
  kept_programs.clear()
  jax.clear_caches()
  gc.collect()
