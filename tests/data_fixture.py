"""Small data files in each benchmark / prompt-source format, written for tests.

A clone has no `../shared/data`; tests that only need the *formats* (field names,
split rules, file kinds) read these instead. The records are made up here, a few
per file, with task ids on both sides of every split boundary the code applies.
Tests that need the real files (record counts, real first lines) skip without
them and run where `$FLEXDRAFT_DATA` (or `../shared/data`) holds them, as in CI.
"""

from __future__ import annotations

import gzip
import json
import os

# MBPP task ids around the splits: 1-10 few-shot, 11-510 test, 511-600
# validation, 601-974 train (training uses 511-974, evaluation 11-510).
MBPP_IDS = (3, 10, 11, 200, 510, 511, 600, 601, 974)
MBPP_TRAIN_IDS = tuple(i for i in MBPP_IDS if 511 <= i <= 974)
MBPP_TEST_IDS = tuple(i for i in MBPP_IDS if 11 <= i <= 510)


def _gsm8k(n: int, split: str) -> list:
  return [{"question": f"A {split} box holds {k + 2} red and {k + 3} blue pens. "
                       "How many pens are in it?",
           "answer": f"{k + 2} + {k + 3} = <<{k + 2}+{k + 3}={2 * k + 5}>>{2 * k + 5}\n"
                     f"#### {2 * k + 5}"} for k in range(n)]


def _mbpp_full() -> list:
  return [{"text": f"Write a function that returns {i} plus its argument.",
           "code": f"def add_{i}(x):\n    return x + {i}", "task_id": i,
           "test_setup_code": "",
           "test_list": [f"assert add_{i}(1) == {i + 1}", f"assert add_{i}(0) == {i}",
                         f"assert add_{i}(-{i}) == 0"],
           "challenge_test_list": []} for i in MBPP_IDS]


def _mbpp_sanitized() -> list:
  return [{"source_file": "fixture", "task_id": i,
           "prompt": f"Write a function that returns {i} plus its argument.",
           "code": f"def add_{i}(x):\n    return x + {i}", "test_imports": [],
           "test_list": [f"assert add_{i}(1) == {i + 1}"]} for i in MBPP_IDS]


def write(root: str) -> str:
  """Writes every format under `root` (the layout of `$FLEXDRAFT_DATA`); returns root."""

  def put(rel: str, rows: list, *, jsonl: bool = True):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) if jsonl else json.dumps(rows)
    if rel.endswith(".gz"):
      with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text)
    else:
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)

  put("gsm8k/train.jsonl", _gsm8k(5, "train"))
  put("gsm8k/test.jsonl", _gsm8k(3, "test"))
  put("mbpp/mbpp.jsonl", _mbpp_full())
  put("mbpp/sanitized-mbpp.json", _mbpp_sanitized(), jsonl=False)
  put("arena_hard/question_v0.1.jsonl", [
      {"uid": f"v01-{k}", "category": "arena-hard-v0.1", "cluster": "tips",
       "prompt": f"Give {k + 2} tips for writing clear emails."} for k in range(3)])
  put("arena_hard/question_v2.0.jsonl", [
      {"uid": f"v20-{k}", "category": "hard_prompt", "subcategory": "coding",
       "prompt": f"Explain list comprehensions in {k + 2} sentences."} for k in range(3)])
  put("math500/test.jsonl", [
      {"problem": f"What is ${k} + {k}$?", "solution": f"${k} + {k} = {2 * k}$.",
       "answer": str(2 * k), "subject": "Prealgebra", "level": 1,
       "unique_id": f"test/prealgebra/{k}.json"} for k in range(3)])
  put("humaneval/HumanEval.jsonl.gz", [
      {"task_id": f"HumanEval/{k}",
       "prompt": f"def twice_{k}(x):\n    \"\"\"Return 2 * x.\"\"\"\n",
       "canonical_solution": "    return 2 * x\n",
       "test": f"def check(f):\n    assert f(2) == 4\n", "entry_point": f"twice_{k}"}
      for k in range(2)])
  put("mt_bench/question.jsonl", [
      {"question_id": 81 + k, "category": "writing",
       "turns": [f"Write a {k + 3}-line poem about rain.", "Now make it rhyme."]}
      for k in range(3)])
  return root
