"""One sweep cell: its parameters, its warm-up, its timed run(s), its lossless check.

A cell runs all prompts of one dataset at one (batch size, mode, temperature,
θ, drafter variant). Multi-turn prompts (MT-Bench) ask turn k+1 after the
model's own answer to turn k, so every turn is a separate `generate` call and
the cell's stats add up over turns.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Optional

import ml_collections
import numpy as np

from flexdraft_jax.decoding import call_stats, timing
from flexdraft_jax.decoding.options import (Mode, RuntimeOptions, SpecOptions,
                                            parse_flex_threshold)
from flexdraft_jax.decoding.sampling import SamplingParams
from flexdraft_jax.evaluation import benchmarks
from flexdraft_jax.model.config import FlexDraftError

# sweep mode -> (generate's mode, uses the selective-verification θ)
MODES = {"ar": (Mode.AR, False), "parallel": (Mode.PARALLEL, False),
         "parallel_sel": (Mode.PARALLEL, True), "sequential": (Mode.SEQUENTIAL, False),
         "flex": (Mode.FLEX, True)}


class Cell(NamedTuple):
  dataset: str
  batch_size: int
  mode: str            # a key of MODES
  temperature: float
  theta: float = 0.0
  drafter: str = "-"   # drafter variant: "main", "nocalib", "L2", … ("-" for ar)

  @property
  def key(self) -> str:
    return (f"{self.dataset}|bs={self.batch_size}|{self.mode}|T={self.temperature:g}"
            f"|theta={self.theta:g}|drafter={self.drafter}")

  @property
  def ar_key(self) -> str:
    return Cell(self.dataset, self.batch_size, "ar", self.temperature).key


_COMPILES: list = []   # names of functions compiled since the listener was added
_LISTENING = [False]


def _on_event(event: str, duration: float, **kw):
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES.append(str(kw.get("fun_name", "")))


def listen_for_compiles():
  """Counts backend compiles (by function name) from now on."""
  if not _LISTENING[0]:
    import jax
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    _LISTENING[0] = True


class Context(NamedTuple):
  config: ml_collections.ConfigDict
  target: object
  drafters: dict       # variant -> Drafter
  prompts: dict        # dataset -> [BenchmarkPrompt]
  max_len: dict        # (dataset, turn) -> KV-cache length
  options: dict = {}   # variant -> SpecOptions fields of its own (e.g. draft_dtype)


def max_lens(target, prompts: dict, config, block: int) -> dict:
  """A KV-cache length per (dataset, turn) so every batch of a cell (and its
  warm-up) compiles to the same shapes."""
  ec, tok = config.eval, target.tokenizer
  kw = benchmarks.chat_kwargs(target)
  out = {}
  for ds, rows in prompts.items():
    n_turns = max(len(p.turns) for p in rows)
    first = max(len(benchmarks.render(tok, benchmarks.messages_for_turn(p, []), kw))
                for p in rows)
    longest = first
    for turn in range(n_turns):
      if turn:  # earlier turns + an answer of max_new tokens + this turn (an upper bound)
        longest += ec.max_new_tokens + 16 + max(
            len(benchmarks.render(tok, [{"role": "user", "content": p.turns[turn]}], kw))
            for p in rows if len(p.turns) > turn)
      if longest + ec.max_new_tokens > target.config.max_position_embeddings:
        raise FlexDraftError(
            f"{ds} turn {turn + 1}: prompts up to {longest} tokens + max_new_tokens="
            f"{ec.max_new_tokens} exceed the model's context of "
            f"{target.config.max_position_embeddings}")
      out[(ds, turn)] = ec.max_len or longest + ec.max_new_tokens + 2 * block + 1
  return out


def _run_lengths(stats: list, key: str) -> dict:
  """{value: steps} from the engine's run-length logs ([[value, steps], …])."""
  out = {}
  for x in stats:
    for value, steps in x.get(key, []):
      out[str(value)] = out.get(str(value), 0) + int(steps)
  return out


def _merge(stats: list) -> dict:
  """Stats of several generate calls (turns) as one."""
  s = {k: sum(x[k] for x in stats) for k in
       ("decode_seconds", "prefill_seconds", "compile_seconds", "flex_timing_seconds",
        "new_tokens", "decode_tokens", "steps", "committed_tokens", "verified_row_steps")}
  hist = np.zeros(max(len(x["accept_hist"]) for x in stats), np.int64)
  for x in stats:
    hist[:len(x["accept_hist"])] += x["accept_hist"]
  s["accept_hist"] = hist.tolist()
  # as generate's stats: tokens of decode steps per decode second (SPEC §5)
  s["tokens_per_second"] = timing.tokens_per_second(s["decode_tokens"], s["decode_seconds"])
  # τ counts emitted tokens only (nothing past a stop or max_new_tokens)
  s["tau"] = s["decode_tokens"] / max(s["verified_row_steps"], 1)
  s["mode_emitted"], s["mode_tau"] = call_stats.mode_emitted(stats), call_stats.mode_tau(stats)
  groups = _run_lengths(stats, "group_counts")
  s["mean_groups"] = (sum(int(g) * n for g, n in groups.items()) / sum(groups.values())
                      if groups else None)
  s["mode_steps"] = _run_lengths(stats, "mode_steps")
  s["step_costs"] = {b: c for x in stats for b, c in x.get("step_costs", {}).items()}
  return s


def _generate(ctx: Context, cell: Cell, rows: list, max_new: int = 0) -> tuple:
  """All turns of `rows` (up to `max_new` new tokens each; 0: eval.max_new_tokens).
  Returns (outputs[row][turn], prompt_ids[row][turn], stats)."""
  from flexdraft_jax import api
  ec, tok = ctx.config.eval, ctx.target.tokenizer
  kw = benchmarks.chat_kwargs(ctx.target)
  mode, _ = MODES[cell.mode]
  drafter = None if mode == Mode.AR else ctx.drafters[cell.drafter]
  # only the modes they act on get the speculative options (generate warns otherwise)
  spec = SpecOptions()
  if mode != Mode.AR:
    spec = SpecOptions(
        threshold=cell.theta, strategy=ec.strategy, block_size=ec.block_size or None,
        flex_threshold=(parse_flex_threshold(ec.flex_threshold, "eval.flex_threshold")
                        if mode == Mode.FLEX else "auto"),
        **ctx.options.get(cell.drafter, {}))
  answers = [[] for _ in rows]
  outputs = [[] for _ in rows]
  prompt_ids = [[] for _ in rows]
  stats = []
  for turn in range(max(len(p.turns) for p in rows)):
    live = [i for i, p in enumerate(rows) if len(p.turns) > turn]
    ids = [benchmarks.render(tok, benchmarks.messages_for_turn(rows[i], answers[i]), kw)
           for i in live]
    res = api.generate(
        ctx.target, ids, drafter=drafter, mode=mode,
        max_new_tokens=max_new or ec.max_new_tokens,
        sampling=SamplingParams(temperature=cell.temperature), speculation=spec,
        runtime=RuntimeOptions(batch_size=min(cell.batch_size, len(ids)),
                               max_len=ctx.max_len[(cell.dataset, turn)],
                               attn_impl=ec.attn_impl),
        seed=ec.seed)
    for i, x, toks, text in zip(live, ids, res.token_ids, res.texts):
      answers[i].append(text)
      outputs[i].append([int(t) for t in toks])
      prompt_ids[i].append(x)
    stats.append(res.stats)
  return outputs, prompt_ids, _merge(stats)


WARMUP_TOKENS = 40  # new tokens per warm-up row: a few blocks of every mode


def _warmup_rows(rows: list, batch_size: int) -> list:
  """A first full batch, plus the last partial batch if there is one."""
  b = min(batch_size, len(rows))
  tail = len(rows) % b
  return rows[:b] + (rows[-tail:] if tail else [])


def cell_prompts(ctx: Context, cell: Cell) -> list:
  """The cell's prompts: its dataset's, capped at `eval.batches_per_cell` batches."""
  rows = ctx.prompts[cell.dataset]
  cap = ctx.config.eval.batches_per_cell
  return rows[:cap * cell.batch_size] if cap > 0 else rows


def run_cell(ctx: Context, cell: Cell, reference: Optional[dict]) -> dict:
  """Warm-up, timed run(s), lossless check against `reference` (the AR cell)."""
  ec = ctx.config.eval
  rows = cell_prompts(ctx, cell)
  t_start = time.perf_counter()
  if ec.warmup:  # compiles the steps: the token budget is traced, shapes depend on
    # the batch and the cache length only, so a short warm-up compiles them all (and
    # never asks for more tokens than the cell, whose cache length must fit them)
    _generate(ctx, cell, _warmup_rows(rows, cell.batch_size),
              min(WARMUP_TOKENS, ec.max_new_tokens))
  runs = 0
  while True:
    n0 = len(_COMPILES)
    outputs, prompt_ids, stats = _generate(ctx, cell, rows)
    runs += 1
    compiled = [n for n in _COMPILES[n0:] if "_prefill" not in n]
    if not compiled or runs >= ec.max_timing_runs:
      break
  record = {
      "key": cell.key, "params": cell._asdict(), "n_prompts": len(rows),
      "rows_per_batch": min(cell.batch_size, len(rows)), "timing_runs": runs,
      "compiled_during_timing": compiled, **stats,
      "outputs": outputs, "texts": [[ctx.target.tokenizer.decode(t) for t in o]
                                    for o in outputs],
  }
  if cell.mode == "ar":
    record["lossless"] = True if cell.temperature == 0 else None
    record["lossless_detail"] = {"reference": True}
  elif cell.temperature == 0 and reference is not None:
    detail = check_lossless(ctx.target, reference["outputs"], outputs, prompt_ids,
                            ec.lossless_tol)
    record["lossless"] = detail["mismatched"] == 0
    record["lossless_detail"] = detail
  else:
    record["lossless"] = None
    record["lossless_detail"] = {"checked": False}
  record["wall_seconds"] = time.perf_counter() - t_start
  return record


def top2_gap(target, ids) -> float:
  """Gap between the target's two largest logits after the prefix `ids`."""
  from flexdraft_jax import api
  lg = np.asarray(api.target_logits(target, np.asarray([ids], np.int32)))[0, -1]
  top = np.sort(lg)[-2:]
  return float(top[1] - top[0])


def check_lossless(target, ref_outputs, outputs, prompt_ids, tol: float) -> dict:
  """Compares outputs row by row, turn by turn, with the reference (AR) ones.

  At the first differing token of a row the target's top-2 logits are checked:
  within `tol` it is a tie (either token is the target's greedy choice, up to
  float rounding) and the rest of the row is not compared; otherwise a mismatch.
  """
  identical, ties, mismatches = 0, [], []
  for i, (ref, got) in enumerate(zip(ref_outputs, outputs)):
    for turn, (a, b) in enumerate(zip(ref, got)):
      if a == b:
        continue
      j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
      gap = top2_gap(target, list(prompt_ids[i][turn]) + list(a[:j]))
      item = {"row": i, "turn": turn, "index": j, "top2_gap": gap,
              "ar_token": a[j] if j < len(a) else None,
              "token": b[j] if j < len(b) else None}
      (ties if gap <= tol else mismatches).append(item)
      break
    else:
      identical += 1
  return {"identical": identical, "ties": len(ties), "mismatched": len(mismatches),
          "details": (mismatches + ties)[:8]}


