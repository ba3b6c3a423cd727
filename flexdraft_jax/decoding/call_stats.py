"""The stats of a `generate` call: its batches' stats merged (sums, the
acceptance histogram, throughput, τ overall and per mode, flex's choice
records), and the call's seconds split into parts that add up to the whole.
The evaluation sums runs' per-mode τ the same way (`mode_emitted`, `mode_tau`)."""

from __future__ import annotations

import numpy as np

from flexdraft_jax import compile_cache
from flexdraft_jax.decoding import flex_costs, timing


def mode_emitted(parts) -> dict:
  """{mode: [row-steps, tokens emitted]} summed over stats `parts`."""
  out = {}
  for p in parts:
    for m, (r, t) in p.get("mode_emitted", {}).items():
      acc = out.setdefault(m, [0, 0])
      acc[0], acc[1] = acc[0] + r, acc[1] + t
  return out


def mode_tau(parts) -> dict:
  """{mode: τ of its steps, emitted tokens only} over stats `parts`."""
  return {m: t / r for m, (r, t) in mode_emitted(parts).items() if r}


def merge_stats(parts, mode):
  """One stats dict for the call from its batches' stats `parts`."""
  s = {"mode": str(mode), "draft_dtype": parts[0]["draft_dtype"]}
  for k in ("prefill_seconds", "decode_seconds", "compile_seconds", "flex_timing_seconds",
            "new_tokens", "decode_tokens", "steps", "committed_tokens",
            "verified_row_steps"):
    s[k] = sum(p[k] for p in parts)
  width = max(len(p["accept_hist"]) for p in parts)
  hist = np.zeros(width, np.int64)
  for p in parts:
    hist[:len(p["accept_hist"])] += p["accept_hist"]
  s["accept_hist"] = hist.tolist()
  # Decode throughput (SPEC §5): tokens decided after prefill (each row's
  # first token comes from the prefill forward) per second of decoding;
  # compiling and flex's step-cost timing are not decoding.
  s["tokens_per_second"] = timing.tokens_per_second(s["decode_tokens"], s["decode_seconds"])
  # τ (SPEC §5): tokens emitted per row verification (nothing past a stop or
  # max_new_tokens: `committed_tokens` counts those too), overall and per mode
  s["tau"] = s["decode_tokens"] / max(s["verified_row_steps"], 1)
  s["mode_emitted"], s["mode_tau"] = mode_emitted(parts), mode_tau(parts)
  for k in ("group_counts", "mode_steps"):  # run-length [value, steps] lists
    s[k] = [x for p in parts for x in p.get(k, [])]
  if "flex_threshold" in parts[0]:
    s["flex_threshold"] = parts[0]["flex_threshold"]
    s["step_costs"] = {b: c for p in parts for b, c in p["step_costs"].items()}
    # per batch shape, the choice record of the last batch of that shape, with
    # the chunks of every batch of that shape summed
    s["flex_choices"] = {b: dict(c) for p in parts for b, c in p.get("flex_choices", {}).items()}
    for b, c in s["flex_choices"].items():
      runs = [p["flex_choices"][b]["chunks"] for p in parts
              if "chunks" in p.get("flex_choices", {}).get(b, {})]
      if runs:
        c["chunks"] = flex_costs.merge_chunk_records(runs)
  return s


def whole_call_times(stats: dict, start: float, end: float):
  """The call's seconds in `stats`, parts that add up to `seconds`: compiling
  (every program compiled or loaded from the persistent cache, wherever it
  happened, counted once), flex's step timing, prefill and decode (each less
  the compiling inside it), and the rest (`other_seconds`)."""
  stats["seconds"] = end - start
  stats["compile_seconds"] = timing.covered(timing.compile_spans(start, end), start, end)
  stats["programs_compiled"], stats["programs_from_cache"] = timing.programs(start, end)
  parts = sum(stats[k] for k in ("compile_seconds", "flex_timing_seconds",
                                 "prefill_seconds", "decode_seconds"))
  stats["other_seconds"] = max(stats["seconds"] - parts, 0.0)
  stats["compile_cache"] = compile_cache.folder()
