"""Training prompts: the sources of the mix (GSM8K train, MBPP 511–974,
Arena-Hard, questions the target wrote (self_instruct.py); never eval sets)
and their variants, the same questions framed another way (`VARIANTS`)."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from typing import NamedTuple

import numpy as np

from flexdraft_jax.evaluation.benchmarks import (CODE_INSTRUCTION, MATH_INSTRUCTION,
                                                 complete_function)
from flexdraft_jax.model.config import FlexDraftError

SOURCES = ("gsm8k", "mbpp", "arena_hard_v01", "arena_hard_v20", "self_instruct")


class Prompt(NamedTuple):
  uid: str      # "<source>:<id>", stable across runs
  source: str
  text: str


def _jsonl(path: str) -> list:
  if not os.path.isfile(path):
    raise FlexDraftError(f"prompt file not found: {path}")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


# Prompt variants: the same training questions framed another way, whose
# greedy answers are new training text. A variant's uid is "<source>:<id>#<name>";
# it stays with its question: held out with it, never in the held-out set
# (`split_eval`). Each maps the sources it frames to the suffix it ends with.
VARIANTS = {
    # The benchmarks' own instructions (evaluation.benchmarks) on training questions.
    "bench": {"gsm8k": MATH_INSTRUCTION, "mbpp": CODE_INSTRUCTION},
    # MBPP tasks framed as HumanEval frames a prompt: a function to complete.
    "fn": {"mbpp": ""},
    # The same, with every test as a HumanEval-style example (call, then its value).
    "doc": {"mbpp": ""},
}


def read_source(source: str, path: str, suffix: str = "", variant: str = "") -> list:
  """All prompts of one source (training splits only), or of its `variant`
  (none when the variant does not frame this source)."""
  if variant:
    if variant not in VARIANTS:
      raise FlexDraftError(f"unknown prompt variant {variant!r} (known: "
                           f"{', '.join(VARIANTS)})")
    if source not in VARIANTS[variant]:
      return []
    suffix = VARIANTS[variant][source]
  if source == "gsm8k":
    rows = [Prompt(f"gsm8k:{i}", source, r["question"]) for i, r in enumerate(_jsonl(path))]
  elif source == "mbpp":
    # MBPP validation (511-600) + train (601-974); 1-510 are test/few-shot.
    tasks = [r for r in _jsonl(path) if 511 <= int(r["task_id"]) <= 974]
    if variant in ("fn", "doc"):
      rows = [Prompt(f"mbpp:{r['task_id']}", source, complete_function(code))
              for r in tasks if (code := mbpp_function(r, examples=variant == "doc"))]
    else:
      rows = [Prompt(f"mbpp:{r['task_id']}", source,
                     f"{r['text']}\nYour code should pass this test:\n{r['test_list'][0]}")
              for r in tasks]
  elif source.startswith("arena_hard"):
    rows = [Prompt(f"{source}:{r['uid']}", source, r["prompt"]) for r in _jsonl(path)]
  elif source == "self_instruct":  # uids are "self_instruct:SEED-CANDIDATE" already
    if not os.path.isfile(path):
      raise FlexDraftError(f"no self-instruct questions at {path}: make them first with "
                           "python -m flexdraft_jax self-instruct --config CONFIG --num=N")
    rows = [Prompt(r["uid"], source, r["question"]) for r in _jsonl(path)]
  else:
    raise FlexDraftError(f"unknown prompt source {source!r} (known: {', '.join(SOURCES)})")
  if suffix:
    rows = [p._replace(text=p.text + suffix) for p in rows]
  if variant:
    rows = [p._replace(uid=f"{p.uid}#{variant}") for p in rows]
  return rows


def mbpp_function(task: dict, examples: bool = False) -> str:
  """An MBPP task as a function to complete: the reference code's imports and
  the signature of the function its first test calls, with the task and that
  test as the docstring ("" when the code defines no such function on one line).
  With `examples`, the docstring shows every `assert CALL == VALUE` test as
  HumanEval shows one: `>>> CALL`, then `VALUE`."""
  test = task["test_list"][0]
  lines = [l.rstrip() for l in task["code"].replace("\r\n", "\n").split("\n")]
  imports = [l for l in lines if l.startswith(("import ", "from "))]
  for line in lines:
    name = line[4:].partition("(")[0].strip() if line.startswith("def ") else ""
    if name and f"{name}(" in test and line.endswith(":"):
      if examples:
        shown = [f"    >>> {call}\n    {value}"
                 for call, value in filter(None, map(_call_and_value, task["test_list"]))]
      else:
        shown = [f"    >>> {test.removeprefix('assert ').strip()}\n    True"]
      doc = "\n".join([f'    """{task["text"].strip()}', *shown, '    """'])
      return "\n".join(imports + [line, doc])
  return ""


def _call_and_value(test: str):
  """(CALL, VALUE) source text of `assert CALL == VALUE`, else None."""
  try:
    node = ast.parse(test.strip()).body[0]
  except (SyntaxError, IndexError):
    return None
  if not (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)
          and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)):
    return None
  source = test.strip()
  return (ast.get_source_segment(source, node.test.left),
          ast.get_source_segment(source, node.test.comparators[0]))


def load_prompts(data_cfg) -> list:
  """The prompt mix: `data_cfg.mix[source]` prompts of each source (-1: all),
  picked by a seeded shuffle, interleaved round-robin; `data_cfg.variant` frames
  them as that variant does (sources it does not frame are left out)."""
  picked = []
  variant = data_cfg.variant
  for source, count in sorted(dict(data_cfg.mix).items()):
    if count == 0:
      continue
    rows = read_source(source, data_cfg.paths[source],
                       dict(data_cfg.suffix).get(source, ""), variant)
    order = np.random.default_rng([data_cfg.seed, stable_int(source)]).permutation(len(rows))
    picked.append([rows[i] for i in order[:None if count < 0 else count]])
  out = []
  for i in range(max((len(p) for p in picked), default=0)):
    out += [p[i] for p in picked if i < len(p)]
  return out


def stable_int(s: str) -> int:
  return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16)
