"""Time spent compiling, so decode throughput can leave it out (SPEC §5).

JAX reports each trace, lowering and backend compile as a wall-clock span
(`jax.monitoring`); nested spans (a jit traced inside another) overlap, so the
compile time of a window is the length of the union of the spans in it.
"""

from __future__ import annotations

import threading
import time

import jax

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration")
_MAX_SPANS = 4096
_spans: list = []   # (start, end), time.time() seconds, oldest first
_lock = threading.Lock()
_listening = [False]


def _on_span(event: str, start: float, end: float, **_):
  if event in _EVENTS:
    with _lock:
      _spans.append((start, end))
      del _spans[:-_MAX_SPANS]


def listen() -> None:
  """Starts recording compile spans (once per process)."""
  if not _listening[0]:
    jax.monitoring.register_event_time_span_listener(_on_span)
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


def tokens_per_second(decode_tokens: int, decode_seconds: float) -> float:
  """Decode throughput (SPEC §5), the project's one definition: tokens decided
  by decode steps (each row's first token comes from prefill and is not one)
  per second of decoding, compiling and flex's step-cost timing left out."""
  return decode_tokens / max(decode_seconds, 1e-9)
