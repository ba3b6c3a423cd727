"""Evaluation: benchmark loaders on the real files, cells, a tiny resumable sweep, reports."""

from __future__ import annotations

import csv
import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from flexdraft_jax import api
from flexdraft_jax.evaluation import benchmarks, cells, plan, report, sweep
from flexdraft_jax.evaluation.benchmarks import BenchmarkPrompt
from flexdraft_jax.model.config import FlexDraftError
from flexdraft_jax.paths import data_root
from tests import data_fixture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = data_root()
needs_data = pytest.mark.skipif(not os.path.isdir(DATA), reason=(
    f"needs the real benchmark files ({DATA}; set $FLEXDRAFT_DATA): CI has them"))


@pytest.fixture(params=["fixture", "real"])
def data_dir(request, tmp_path_factory):
  """Benchmark files: small ones in each format (a clone has these), then the real ones."""
  if request.param == "fixture":
    return data_fixture.write(str(tmp_path_factory.mktemp("data")))
  if not os.path.isdir(DATA):
    pytest.skip(f"needs the real benchmark files ({DATA}; set $FLEXDRAFT_DATA): CI has them")
  return DATA


# ------------------------------------------------------------ benchmarks ----

@needs_data
@pytest.mark.parametrize("name,count,turns", [
    ("gsm8k", 1319, 1), ("math500", 500, 1), ("humaneval", 164, 1), ("mbpp", 257, 1),
    ("mt_bench", 80, 2)])
def test_benchmark_counts(name, count, turns):
  rows = benchmarks.load_benchmark(name, DATA, 0)
  assert len(rows) == count
  assert {len(r.turns) for r in rows} == {turns}
  assert len({r.uid for r in rows}) == count
  assert all(r.benchmark == name and all(t.strip() for t in r.turns) for r in rows)


def test_prompt_formats(data_dir):
  DATA = data_dir
  with open(os.path.join(DATA, "gsm8k", "test.jsonl")) as f:
    q0 = json.loads(f.readline())["question"]
  gsm = benchmarks.load_benchmark("gsm8k", DATA, 2)
  assert gsm[0].turns[0] == q0 + benchmarks.MATH_INSTRUCTION
  math = benchmarks.load_benchmark("math500", DATA, 3)
  assert all(r.turns[0].endswith(benchmarks.MATH_INSTRUCTION) for r in gsm + math)
  assert "Final Answer: \\boxed{" in benchmarks.MATH_INSTRUCTION

  with gzip.open(os.path.join(DATA, "humaneval", "HumanEval.jsonl.gz"), "rt") as f:
    he0 = json.loads(f.readline())
  he = benchmarks.load_benchmark("humaneval", DATA, 1)[0]
  assert f"```python\n{he0['prompt']}\n```" in he.turns[0]
  mbpp = benchmarks.load_benchmark("mbpp", DATA, 0)
  assert mbpp[0].uid == "mbpp:11" and max(int(r.uid[5:]) for r in mbpp) <= 510
  assert "Your code should pass this test:\nassert " in mbpp[0].turns[0]
  for r in [he] + mbpp:
    assert r.turns[0].endswith(benchmarks.CODE_INSTRUCTION)
  assert "one markdown code block" in benchmarks.CODE_INSTRUCTION

  with open(os.path.join(DATA, "mt_bench", "question.jsonl")) as f:
    mt0 = json.loads(f.readline())
  mt = benchmarks.load_benchmark("mt-bench", DATA, 3)  # an alias
  assert len(mt) == 3 and mt[0].turns == tuple(mt0["turns"]) and mt[0].benchmark == "mt_bench"


def test_missing_file_is_one_line(tmp_path):
  with pytest.raises(FlexDraftError) as e:
    benchmarks.load_benchmark("gsm8k", str(tmp_path), 5)
  msg = str(e.value)
  assert "\n" not in msg
  assert os.path.join(str(tmp_path), "gsm8k", "test.jsonl") in msg
  assert "openai/grade-school-math" in msg
  with pytest.raises(FlexDraftError, match="unknown benchmark"):
    benchmarks.load_benchmark("nope", str(tmp_path))


class _Tok:
  """Records the template kwargs; renders messages as 'role:content|…'."""

  def __init__(self):
    self.kwargs = None

  def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
    self.kwargs = kw
    return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

  def encode(self, text):
    return list(text.encode())


def test_chat_rendering_disables_qwen3_thinking():
  from types import SimpleNamespace
  qwen3 = SimpleNamespace(config=SimpleNamespace(model_type="qwen3"))
  llama = SimpleNamespace(config=SimpleNamespace(model_type="llama"))
  assert benchmarks.chat_kwargs(qwen3) == {"enable_thinking": False}
  assert benchmarks.chat_kwargs(llama) == {}
  tok = _Tok()
  p = BenchmarkPrompt("x:0", "x", ("first?", "second?"))
  ids = benchmarks.render(tok, benchmarks.messages_for_turn(p, ["ans one"]),
                          benchmarks.chat_kwargs(qwen3))
  assert tok.kwargs == {"enable_thinking": False}
  assert bytes(ids).decode() == "user:first?|assistant:ans one|user:second?|assistant:"


# ----------------------------------------------------------------- cells ----

def _fake_stats(n_tokens):
  return {"decode_seconds": 0.5, "prefill_seconds": 0.1, "compile_seconds": 0.0,
          "flex_timing_seconds": 0.0, "new_tokens": n_tokens, "decode_tokens": n_tokens - 2,
          "steps": 2, "committed_tokens": n_tokens, "verified_row_steps": 2,
          "accept_hist": [0, 1, 1], "group_counts": [[3, 2]], "mode_steps": [["parallel", 2]]}


def test_mt_bench_second_turn_follows_own_first_answer(monkeypatch):
  target = api.load_target("random:tiny")
  seen = []

  def fake_generate(target, ids, **kw):
    seen.append([target.tokenizer.decode(x) for x in ids])
    texts = [f"ANSWER{len(seen)}-{i}" for i in range(len(ids))]
    toks = [target.tokenizer.encode(t) for t in texts]
    return api.GenerateResult(toks, texts, _fake_stats(sum(map(len, toks))))

  monkeypatch.setattr(api, "generate", fake_generate)
  config = sweep.default_config()
  rows = [BenchmarkPrompt("m:0", "mt", ("Plan a trip.", "Make it shorter.")),
          BenchmarkPrompt("m:1", "mt", ("Name a bird.", "Why that one?"))]
  ctx = cells.Context(config, target, {}, {"mt": rows}, {("mt", 0): 256, ("mt", 1): 512})
  outputs, prompt_ids, stats = cells._generate(ctx, cells.Cell("mt", 2, "ar", 0.0), rows)
  assert len(seen) == 2                      # one generate call per turn
  for i, row in enumerate(rows):
    first, second = seen[0][i], seen[1][i]
    assert row.turns[0] in first and f"ANSWER1-{i}" not in first
    assert second.index(row.turns[0]) < second.index(f"ANSWER1-{i}") < second.index(row.turns[1])
    assert len(outputs[i]) == len(prompt_ids[i]) == 2
  assert stats["decode_seconds"] == 1.0 and stats["steps"] == 4
  assert stats["accept_hist"] == [0, 2, 2] and stats["mean_groups"] == 3.0
  assert stats["mode_steps"] == {"parallel": 4}


def test_check_lossless_excuses_only_near_ties(monkeypatch):
  gaps = iter([0.0, 0.5])
  monkeypatch.setattr(cells, "top2_gap", lambda target, ids: next(gaps))
  ref = [[[1, 2, 3], [4, 5]], [[1, 2], [3]], [[7, 8], [9]]]
  got = [[[1, 2, 3], [4, 5]], [[1, 9], [0]], [[7, 6], [9]]]
  prompts = [[[0], [0]]] * 3
  d = cells.check_lossless(None, ref, got, prompts, tol=1e-5)
  assert (d["identical"], d["ties"], d["mismatched"]) == (1, 1, 1)
  mismatch = d["details"][0]
  assert (mismatch["row"], mismatch["index"], mismatch["ar_token"], mismatch["token"]) == (2, 1, 8, 6)


def test_plan_and_settings_errors():
  config = sweep.default_config()
  config.ablation.enabled = False
  config.eval.update(datasets="gsm8k,mt-bench", batch_sizes="1,4", modes="parallel,flex")
  keys = [c.key for c in plan.plan_cells(config, [])]
  assert len(keys) == 2 * 2 * 3 and keys[0].startswith("gsm8k|bs=1|ar|")  # ar added, first
  assert all(k.startswith("mt_bench") for k in keys[6:])
  config.eval.modes = "ar,turbo"
  with pytest.raises(FlexDraftError, match="unknown mode 'turbo'"):
    plan.plan_cells(config, [])
  meta = {"target_fingerprint": "a", "drafter_id": "d", "settings": {"max_new_tokens": 8},
          "prompts": {"gsm8k": "p"}, "ablation_drafters": {}}
  assert sweep._check_meta({}, meta, "W") == meta
  with pytest.raises(FlexDraftError, match="use another --workdir"):
    sweep._check_meta(meta, dict(meta, settings={"max_new_tokens": 16}), "W")


def test_parallel_cells_are_not_run_for_a_drafter_trained_only_to_read_the_bonus():
  import types
  from flexdraft_jax.drafter.model import DrafterConfig
  config = sweep.default_config()
  config.eval.update(datasets="gsm8k", batch_sizes="1", modes="parallel,parallel_sel,sequential,flex")
  planned = plan.plan_cells(config, [])
  as_ = lambda **kw: {"main": types.SimpleNamespace(config=DrafterConfig(**kw))}
  reads = as_(bonus_input=True)
  assert [c.mode for c in planned if plan.runnable(c, reads)] == ["ar", "sequential", "flex"]
  for drafters in (as_(bonus_input=False), as_(bonus_input=True, bonus_dropout=0.5)):
    assert all(plan.runnable(c, drafters) for c in planned)


def test_report_speedup_is_tokens_per_second_ratio(tmp_path):
  def cell(mode, tps, drafter="-", theta=0.0):
    key = f"gsm8k|bs=1|{mode}|T=0|theta={theta:g}|drafter={drafter}"
    return key, {"params": dict(dataset="gsm8k", batch_size=1, mode=mode, temperature=0.0,
                                theta=theta, drafter=drafter),
                 "n_prompts": 1, "new_tokens": 10, "decode_seconds": 10 / tps,
                 "tokens_per_second": tps, "tau": 1.0 if mode == "ar" else 2.5,
                 "lossless": True, "steps": 4, "timing_runs": 1, "accept_hist": [0, 1, 2, 1]}
  results = {"meta": {}, "cells": dict([cell("ar", 10.0), cell("parallel", 25.0, "main")]),
             "ablation": []}
  by_mode = {r["mode"]: r for r in report.rows(results)}
  assert by_mode["ar"]["speedup"] == 1.0 and by_mode["parallel"]["speedup"] == 2.5
  assert any("2.50× (2.50)" in line for line in report.speedup_table(results, 0.0))


def test_ablation_by_dataset_has_a_column_per_dataset_and_marks_missing_cells():
  def cell(ds, mode, tps, tau, drafter="-", bs=1):
    key = f"{ds}|bs={bs}|{mode}|T=0|theta=0|drafter={drafter}"
    return key, {"params": dict(dataset=ds, batch_size=bs, mode=mode, temperature=0.0,
                                theta=0.0, drafter=drafter),
                 "n_prompts": 1, "new_tokens": 10, "decode_seconds": 10 / tps,
                 "prefill_seconds": 1.0, "tokens_per_second": tps, "tau": tau,
                 "lossless": True, "steps": 4, "timing_runs": 1, "accept_hist": [0, 1]}
  cells = dict([cell("gsm8k", "ar", 10.0, 1.0), cell("gsm8k", "parallel", 20.0, 2.5, "paper"),
                cell("mbpp", "ar", 10.0, 1.0), cell("mbpp", "parallel", 15.0, 1.75, "paper")])
  rows = [{"name": "+ bonus calibration", "note": "",
           "cells": [k for k in cells if "parallel" in k]},
          {"name": "sequential", "note": "", "cells": ["gsm8k|bs=1|sequential|T=0|theta=0|"
                                                       "drafter=paper"]}]
  results = {"meta": {}, "cells": cells, "ablation": rows,
             "ablation_settings": {"datasets": ["gsm8k", "mbpp", "mt_bench"]}}
  lines = report.ablation_by_dataset(results)
  assert lines[0].startswith("Batch 1:")
  assert "| variant | mode | gsm8k | mbpp | mt_bench |" in lines
  # end to end: 10 tokens in 0.5 + 1 s against AR's 1 + 1 s
  assert "| + bonus calibration | parallel θ=0 | 2.50 / 2.00× (1.33×) | 1.75 / 1.50× " \
         "(1.20×) | — |" in lines
  assert "| sequential |  | — | — | — |" in lines


def test_step_cost_table_shows_the_break_even_tau():
  costs = {"4": {"ar": 0.02, "measured_k": [2, 16],
                 "sequential": {"2": 0.03, "9": 0.04, "16": 0.05},
                 "parallel": {"2": 0.06, "9": 0.08, "16": 0.1}}}
  results = {"cells": {"k": {"params": {"mode": "flex"}, "step_costs": costs},
                       "a": {"params": {"mode": "ar"}}}}
  table = report.step_cost_table(results)
  assert table[0] == ("| rows | ar | sequential k=2 | sequential k=9 | sequential k=16 | "
                      "parallel k=2 | parallel k=9 | parallel k=16 |")
  assert table[2] == ("| 4 | 20.0 ms | 30.0 ms (τ 1.50) | ~40.0 ms (τ 2.00) | "
                      "50.0 ms (τ 2.50) | 60.0 ms (τ 3.00) | ~80.0 ms (τ 4.00) | "
                      "100.0 ms (τ 5.00) |")
  assert report.step_cost_table({"cells": {"a": {"params": {"mode": "ar"}}}}) == []


def test_step_cost_table_of_a_drafter_without_parallel_mode():
  # A bonus-input drafter's flex times sequential steps only (it crashed the report
  # after a whole sweep had run).
  costs = {"1": {"ar": 0.02, "measured_k": [2, 8],
                 "sequential": {"2": 0.03, "8": 0.05}}}
  results = {"cells": {"k": {"params": {"mode": "flex"}, "step_costs": costs}}}
  table = report.step_cost_table(results)
  assert table[0] == "| rows | ar | sequential k=2 | sequential k=8 |"
  assert table[2] == "| 1 | 20.0 ms | 30.0 ms (τ 1.50) | 50.0 ms (τ 2.50) |"


def test_batches_per_cell_caps_a_cells_prompts():
  config = sweep.default_config()
  rows = [BenchmarkPrompt(f"gsm8k:{i}", "gsm8k", (f"q{i}",)) for i in range(16)]
  ctx = cells.Context(config, None, {}, {"gsm8k": rows}, {})
  cell = lambda b: cells.Cell("gsm8k", b, "ar", 0.0)
  assert cells.cell_prompts(ctx, cell(1)) == rows          # 0: every prompt
  config.eval.batches_per_cell = 2
  assert cells.cell_prompts(ctx, cell(1)) == rows[:2]
  assert cells.cell_prompts(ctx, cell(4)) == rows[:8]
  assert cells.cell_prompts(ctx, cell(16)) == rows


# ----------------------------------------------------------------- sweep ----

PROMPTS = {"gsm8k": ["What is 2+3?", "What is 7*6?"],
           "mt_bench": [["Hi there.", "Say more."], ["Name a fruit.", "Why?"]]}


def _eval_cli(workdir, prompts_file):
  """The CLI on random:tiny with a random drafter. θ=0 and an integer B* keep
  the compiled step variants few; low XLA optimisation compiles faster."""
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS="--xla_backend_optimization_level=0")
  cmd = [sys.executable, "-m", "flexdraft_jax", "eval",
         "--config", os.path.join(REPO, "configs", "eval_smollm2.py"), "--workdir", workdir,
         "--config.target=random:tiny", "--config.drafter=",  # "": a random drafter
         "--config.random_drafter.num_layers=2",
         "--config.random_drafter.block_size=4", "--config.random_drafter.calib_rank=16",
         f"--config.eval.prompts_file={prompts_file}", "--config.eval.datasets=gsm8k,mt_bench",
         "--config.eval.batch_sizes=2", "--config.eval.max_new_tokens=6",
         "--config.eval.max_len=256", "--config.eval.theta=0", "--config.eval.flex_threshold=1",
         "--config.ablation.datasets=gsm8k", "--config.ablation.batch_sizes=2",
         "--config.ablation.layer_drafters.L2=",  # "": the main drafter (it has L=2)
         f"--config.ablation.layer_drafters.L6={workdir}/missing_L6"]
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout + out.stderr


def test_sweep_cli_outputs_lossless_and_resumes(tmp_path):
  prompts_file = tmp_path / "prompts.json"
  prompts_file.write_text(json.dumps(PROMPTS))
  workdir = str(tmp_path / "eval")
  log = _eval_cli(workdir, str(prompts_file))
  assert "RANDOMLY INITIALISED" in log and "12 cells run, 0 already done" in log
  assert f"eval: writing results to {os.path.abspath(workdir)} (--workdir)" in log

  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  cells_ = results["cells"]
  modes = {"ar", "parallel", "parallel_sel", "sequential", "flex"}
  for ds in PROMPTS:
    assert {c["params"]["mode"] for c in cells_.values() if c["params"]["dataset"] == ds} == modes
  # 2 datasets x 5 modes + the ablation's no-calibration and fp32-draft-pass cells
  # (its other rows are these cells: the random drafter has no additions)
  assert len(cells_) == 12
  assert all(c["lossless"] is True for c in cells_.values()), \
      {k: c["lossless_detail"] for k, c in cells_.items() if not c["lossless"]}
  ar = cells_["mt_bench|bs=2|ar|T=0|theta=0|drafter=-"]
  assert [len(o) for o in ar["outputs"]] == [2, 2]          # both turns answered
  assert all(0 < len(t) <= 6 for o in ar["outputs"] for t in o)
  for c in cells_.values():
    assert c["decode_seconds"] > 0 and c["new_tokens"] > 0 and c["tau"] >= 1.0
    assert sum(c["accept_hist"]) > 0

  with open(os.path.join(workdir, "results.csv")) as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == 12
  assert all(float(r["speedup"]) == 1.0 for r in rows if r["mode"] == "ar")
  assert all(r["lossless"] == "True" and float(r["speedup"]) > 0 for r in rows)
  md = open(os.path.join(workdir, "results.md")).read()
  assert "## Speedup over AR, T=0" in md and "## Ablations" in md and "### By dataset" in md
  assert "| attention tuning only (no calibration) | 2 | parallel θ=0 |" in md
  assert "| sequential + bonus input | | | | | | | | skipped: the drafter reads no" in md
  assert "decode only / end to end" in md
  assert f"skipped: no drafter at {workdir}/missing_L6" in md
  assert "| L = 2 draft layers (θ=0) | 2 | parallel selective θ=0 |" in md  # the main drafter
  for name in ("speedup_vs_batch_T0.png", "tau_per_dataset.png", "accept_hist.png"):
    with open(os.path.join(workdir, name), "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"

  log = _eval_cli(workdir, str(prompts_file))  # resumes: nothing is rerun
  assert "0 cells run, 12 already done" in log
  with open(os.path.join(workdir, "results.json")) as f:
    again = json.load(f)["cells"]
  assert {k: c["decode_seconds"] for k, c in again.items()} == \
      {k: c["decode_seconds"] for k, c in cells_.items()}
  np.testing.assert_equal(again["gsm8k|bs=2|flex|T=0|theta=0|drafter=main"]["outputs"],
                          cells_["gsm8k|bs=2|ar|T=0|theta=0|drafter=-"]["outputs"])


def test_demo_runs_and_reports_speedup(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
             XLA_FLAGS="--xla_backend_optimization_level=0")
  cmd = [sys.executable, "-m", "flexdraft_jax.evaluation.demo", "--model", "random:tiny",
         "--drafter", str(tmp_path / "no_drafter"), "--mode", "parallel", "--threshold", "0",
         "--max-new-tokens", "4"]
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "RANDOMLY INITIALISED" in out.stdout
  assert "=== math:" in out.stdout and "=== code:" in out.stdout and "=== chat:" in out.stdout
  assert "speedup over AR:" in out.stdout and "outputs identical to AR: True" in out.stdout
  assert "decoding 3 prompts (batch 1)" in out.stdout   # one at a time by default
  assert "steps per mode: parallel " in out.stdout and "(τ " in out.stdout
  assert re.search(r"the whole command: \d+\.\ds \(4 generate calls of 3 prompts", out.stdout)


def test_demo_says_what_flex_chose_and_what_its_chunks_measured():
  from flexdraft_jax.evaluation import demo
  stats = {"flex_choices": {"3": {
      "choice": ["ar", 0], "tokens_per_s": {"ar": 45.3, "sequential:4": 40.1, "sequential:8": 38.0},
      "chunks": {"sequential:8": {"steps": 8, "predicted_tokens_per_s": 60.0,
                                  "measured_tokens_per_s": 42.0}}}}}
  lines = demo.flex_lines(stats)
  assert lines[0] == ("flex at batch 3 chose ar: predicted 45.3 tok/s (sequential:4 40.1, "
                      "sequential:8 38.0)")
  assert lines[1] == ("  its chunks, predicted / measured: "
                      "sequential:8 ×8 steps 60.0 / 42.0 tok/s")
  assert demo.flex_lines({}) == []
  trees = {"flex_choices": {"1": {"choice": ["tree", 16], "tokens_per_s": {
      "ar": 30.0, "sequential:8": 50.0, "tree:16": 55.0}}}}
  assert demo.flex_lines(trees)[0] == ("flex at batch 1 chose tree (draft trees of 16 "
                                       "nodes): predicted 55.0 tok/s (sequential:8 50.0, "
                                       "ar 30.0)")


def test_demo_speedup_below_run_to_run_noise_reads_about_1x():
  from flexdraft_jax.evaluation import demo
  # AR runs spread 20 % (10..12 tok/s): a 1.14x median ratio is noise
  assert demo.speedup_text([10.0, 11.0, 12.0], [12.4, 12.5, 12.6]).startswith(
      "≈ 1× (within noise: measured 1.14×")
  # steady runs (1-2 % spread): the same ratio is a speedup, and a slowdown is one too
  assert demo.speedup_text([10.0, 10.1, 10.2], [11.4, 11.5, 11.6]) == "1.14×"
  assert demo.speedup_text([10.0, 10.1, 10.2], [5.0, 5.05, 5.1]) == "0.50×"
  # flex that decoded with AR steps only ran the AR loop: any ratio is noise
  assert demo.speedup_text([10.0, 10.1, 10.2], [11.4, 11.5, 11.6],
                           only_ar_steps=True).startswith("≈ 1× (flex decoded with AR steps")

