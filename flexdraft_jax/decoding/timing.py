"""Time spent compiling, so decode throughput can leave it out (SPEC §5).

JAX reports each trace, lowering and backend compile as a wall-clock span
(`jax.monitoring`); nested spans (a jit traced inside another) overlap, so the
compile time of a window is the length of the union of the spans in it.
"""

from __future__ import annotations

import os
import threading
import time

import jax

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration")
_BACKEND = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"
_MAX_SPANS = 4096
_spans: list = []   # (start, end), time.time() seconds, oldest first
_backend: list = []  # (start, end) of each program compiled or loaded from the cache
_hits: list = []     # time.time() of each program loaded from the persistent cache
_lock = threading.Lock()
_listening = [False]


def _on_span(event: str, start: float, end: float, **_):
  if event in _EVENTS:
    with _lock:
      _spans.append((start, end))
      del _spans[:-_MAX_SPANS]
      if event == _BACKEND:
        _backend.append((start, end))
        del _backend[:-_MAX_SPANS]


def _on_event(event: str, **_):
  if event == _HIT:
    with _lock:
      _hits.append(time.time())
      del _hits[:-_MAX_SPANS]


def listen() -> None:
  """Starts recording compile spans (once per process)."""
  if not _listening[0]:
    jax.monitoring.register_event_time_span_listener(_on_span)
    jax.monitoring.register_event_listener(_on_event)
    _listening[0] = True


def now() -> float:
  """The clock compile spans are measured on."""
  return time.time()


def covered(spans, start: float, end: float) -> float:
  """Seconds of [start, end] inside the union of `spans` ((s, e) pairs)."""
  total, reach = 0.0, start
  for s, e in sorted(spans):
    s, e = max(s, reach), min(e, end)
    if e > s:  # the part not covered yet
      total += e - s
      reach = e
  return total


def compile_spans(start: float, end: float) -> list:
  """The recorded compile spans that overlap [start, end]."""
  with _lock:
    return [(s, e) for s, e in _spans if e > start and s < end]


def programs(start: float, end: float) -> tuple:
  """(programs compiled, programs loaded from the persistent compilation
  cache) in [start, end]: each backend compile that ended there is one or the
  other (a cache hit is recorded inside the backend span it ends)."""
  with _lock:
    ended = [e for s, e in _backend if start <= e <= end]
    hits = sum(start <= t <= end for t in _hits)
  return max(len(ended) - hits, 0), hits


def tokens_per_second(decode_tokens: int, decode_seconds: float) -> float:
  """Decode throughput (SPEC §5), the project's one definition: tokens decided
  by decode steps (each row's first token comes from prefill and is not one)
  per second of decoding, compiling and flex's step-cost timing left out."""
  return decode_tokens / max(decode_seconds, 1e-9)


def process_started() -> float:
  """When this process started (time.time()'s clock): its start in clock ticks
  since boot (Linux's /proc/self/stat) against the boot clock; elsewhere, now."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - max(age, 0.0)
  except (OSError, ValueError, IndexError, AttributeError):
    return time.time()
