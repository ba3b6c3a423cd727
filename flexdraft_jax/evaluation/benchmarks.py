"""Evaluation prompts (SPEC §6) read from local copies of the public benchmark files.

  gsm8k      gsm8k/test.jsonl                 1319  `question`
  math500    math500/test.jsonl                500  `problem`
  humaneval  humaneval/HumanEval.jsonl.gz      164  `prompt` (a function to complete)
  mbpp       mbpp/sanitized-mbpp.json          257  test tasks 11-510: `prompt` + first test
  mt_bench   mt_bench/question.jsonl            80  two turns; turn 2 follows the
                                                    model's own answer to turn 1

Math prompts end with an instruction to answer as `Final Answer: \\boxed{…}`,
code prompts ask for one markdown code block. Prompts reach the model through
its chat template; Qwen3 gets `enable_thinking=False`.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import NamedTuple, Sequence

from flexdraft_jax.model.config import FlexDraftError

MATH_INSTRUCTION = ("\n\nGive your final response as 'Final Answer: \\boxed{<answer>}', "
                    "where <answer> is the final number or mathematical expression.")
CODE_INSTRUCTION = ("\n\nAnswer with the complete solution code in one markdown code "
                    "block (```python ... ```).")

# name -> (file under the data dir, where the file comes from)
FILES = {
    "gsm8k": ("gsm8k/test.jsonl",
              "openai/grade-school-math grade_school_math/data/test.jsonl"),
    "math500": ("math500/test.jsonl", "openai/prm800k prm800k/math_splits/test.jsonl"),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", "openai/human-eval data/HumanEval.jsonl.gz"),
    "mbpp": ("mbpp/sanitized-mbpp.json",
             "google-research/google-research mbpp/sanitized-mbpp.json"),
    "mt_bench": ("mt_bench/question.jsonl",
                 "lm-sys/FastChat fastchat/llm_judge/data/mt_bench/question.jsonl"),
}
BENCHMARKS = tuple(FILES)
_ALIASES = {"mt-bench": "mt_bench", "mtbench": "mt_bench", "math": "math500",
            "math-500": "math500", "human-eval": "humaneval"}


class BenchmarkPrompt(NamedTuple):
  """One evaluation item: user turns asked in order, each after the model's
  answer to the previous one."""
  uid: str                 # "<benchmark>:<id>"
  benchmark: str
  turns: tuple             # user messages (1, or 2 for mt_bench)
  category: str = ""


def canonical_name(name: str) -> str:
  name = name.strip().lower()
  name = _ALIASES.get(name, name)
  if name not in FILES:
    raise FlexDraftError(f"unknown benchmark {name!r} (known: {', '.join(BENCHMARKS)})")
  return name


def data_file(name: str, data_dir: str) -> str:
  """Path of a benchmark's file; one-line FlexDraftError naming it when missing."""
  rel, source = FILES[canonical_name(name)]
  path = os.path.join(data_dir, rel)
  if not os.path.isfile(path):
    raise FlexDraftError(
        f"{name}: data file not found: {path} (get it from {source}; see "
        f"shared/data/README.md; point --config.data_dir or $FLEXDRAFT_DATA at the folder)")
  return path


def _jsonl(path: str) -> list:
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      return [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError) as e:
    raise FlexDraftError(f"cannot read {path}: {e}") from None


def _gsm8k(path):
  return [BenchmarkPrompt(f"gsm8k:{i}", "gsm8k", (r["question"] + MATH_INSTRUCTION,))
          for i, r in enumerate(_jsonl(path))]


def _math500(path):
  return [BenchmarkPrompt(f"math500:{r.get('unique_id', i)}", "math500",
                          (r["problem"] + MATH_INSTRUCTION,), r.get("subject", ""))
          for i, r in enumerate(_jsonl(path))]


def complete_function(code: str) -> str:
  """HumanEval's framing of a function to complete (`code`: its signature and
  docstring), with the code instruction."""
  return ("Complete the following Python function so that it passes its tests:\n"
          f"```python\n{code}\n```" + CODE_INSTRUCTION)


def _humaneval(path):
  return [BenchmarkPrompt(f"humaneval:{r['task_id']}", "humaneval",
                          (complete_function(r["prompt"]),))
          for r in _jsonl(path)]


def _mbpp(path):
  try:
    with open(path, encoding="utf-8") as f:
      rows = json.load(f)
  except (OSError, ValueError) as e:
    raise FlexDraftError(f"cannot read {path}: {e}") from None
  # The sanitized test split: task ids 11-510 (1-10 are few-shot examples).
  return [BenchmarkPrompt(
      f"mbpp:{r['task_id']}", "mbpp",
      (f"{r['prompt']}\nYour code should pass this test:\n{r['test_list'][0]}"
       + CODE_INSTRUCTION,))
          for r in rows if 11 <= int(r["task_id"]) <= 510]


def _mt_bench(path):
  return [BenchmarkPrompt(f"mt_bench:{r['question_id']}", "mt_bench", tuple(r["turns"]),
                          r.get("category", ""))
          for r in _jsonl(path)]


_READERS = {"gsm8k": _gsm8k, "math500": _math500, "humaneval": _humaneval,
            "mbpp": _mbpp, "mt_bench": _mt_bench}


def load_benchmark(name: str, data_dir: str, limit: int = 0) -> list:
  """The first `limit` prompts (all when `limit` <= 0) of benchmark `name` as
  BenchmarkPrompt records, in file order."""
  name = canonical_name(name)
  rows = _READERS[name](data_file(name, data_dir))
  return rows[:limit] if limit and limit > 0 else rows


# ------------------------------------------------------------ rendering ----

def chat_kwargs(target) -> dict:
  """Chat-template variables for this target: Qwen3 answers without thinking."""
  return {"enable_thinking": False} if target.config.model_type == "qwen3" else {}


def render(tokenizer, messages: Sequence[dict], kwargs: dict) -> list:
  """Token ids of `messages` through the chat template, generation prompt added."""
  ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **kwargs)
  if isinstance(ids, str):  # a tokenizer whose template renders text
    ids = tokenizer.encode(ids)
  return [int(t) for t in ids]


def messages_for_turn(prompt: BenchmarkPrompt, answers: Sequence[str]) -> list:
  """The conversation for turn `len(answers)`: each earlier user turn followed
  by the model's own answer to it."""
  turn = len(answers)
  msgs = []
  for user, answer in zip(prompt.turns[:turn], answers):
    msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
  msgs.append({"role": "user", "content": prompt.turns[turn]})
  return msgs
