"""The modes benchmark: the accelerator script end to end on a tiny random target
(CPU: XLA decoding, Pallas kernels in interpret mode), its lossless check, and
flex's (mode, k) step counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import flexdraft_jax as fd
from flexdraft_jax.evaluation import modes_bench
from tests import data_fixture
from tests.decoding_util import random_drafter, tiny_target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _positive(x) -> bool:
  return isinstance(x, (int, float)) and x > 0


def test_accelerator_bench_writes_lossless_positive_tables(tmp_path):
  data = data_fixture.write(str(tmp_path / "data"))
  out = tmp_path / "out"
  env = dict(os.environ, XLA_FLAGS="--xla_backend_optimization_level=0")
  cmd = [sys.executable, "launch/accelerator_bench.py", f"--out_dir={out}", "--minutes=3",
         "--target=random:tiny", "--drafter=", "--batch_sizes=1,2",
         "--fixed=parallel:2,sequential:2,sequential:8,tree:8,tree:256",
         "--flex_trees=16", "--max_new_tokens=8",
         "--repeats=1", f"--data_dir={data}", "--kernel_models=smollm2_135m",
         "--kernel_batches=1", "--kernel_groups=0,2", "--kernel_cache=64",
         "--kernel_commit=20", "--kernel_block=4", "--kernel_iters=1"]
  res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  record = json.loads((out / "accelerator_bench.json").read_text())
  md = (out / "accelerator_bench.md").read_text()
  assert not record["errors"]

  kernels = record["kernels"]
  assert kernels["interpret"] and [r["groups"] for r in kernels["rows"]] == [0, 2]
  for r in kernels["rows"]:
    assert _positive(r["kernel_us"]) and _positive(r["xla_us"]) and r["max_err"] < 0.05

  modes = record["modes"]
  assert modes["attn_impl"] == "xla"  # auto: XLA on a CPU
  assert modes["left_out"] == ["sequential:8"]  # the random drafter's block is 4
  rows = modes["results"]
  assert [r["batch_size"] for r in rows] == [1, 2]
  for r in rows:
    assert r["lossless"] and r["timed_rounds"] == 1
    assert set(r["settings"]) == {"ar", "flex", "flex+tree:16", "parallel:2",
                                  "sequential:2", "tree:8", "tree:256"}
    assert r["settings"]["tree:256"]["tree_budget"] == 256
    for x in r["settings"].values():
      assert x["lossless"]
      assert all(map(_positive, (x["median"], x["best"], x["e2e_median"], x["over_ar"],
                                 x["e2e_over_ar"], x["tau"])))
    flex = r["flex"]
    assert sum(n for _, _, n in flex["mode_k_steps"]) == r["settings"]["flex"]["steps"]
    assert set(flex["cost_model_vs_measured"]) >= {"parallel:2", "sequential:2"}
    # what flex predicted for the chunks it ran, and what they measured
    ran = {f"{m}:{k}" if k else m for m, k, _ in flex["mode_k_steps"]}
    assert set(flex["chunks"]) <= ran
    assert sum(c["steps"] for c in flex["chunks"].values()) <= r["settings"]["flex"]["steps"]
    for c in flex["chunks"].values():
      assert _positive(c["predicted_tokens_per_s"]) and _positive(c["measured_tokens_per_s"])
    assert _positive(flex["step_costs"]["ar"])

  lines = md.splitlines()
  table = [ln for ln in lines if ln.startswith("| 1 |") or ln.startswith("| 2 |")]
  # throughput, τ, and two flex settings' cost-model rows of batches 1 and 2
  assert len(table) == 4 * 2
  throughput = [ln for ln in table if ln.endswith("| yes |")]
  assert len(throughput) == 2
  assert "| smollm2_135m | 1 | 2 | 12 |" in md
  assert "Left out (k beyond the drafter's block): sequential:8." in md


def test_a_changed_output_is_not_lossless():
  target = tiny_target()
  ids = [[5, 6, 7], [9, 10, 11, 12]]
  ref = fd.generate(target, ids, max_new_tokens=6, stop=[]).token_ids
  ok, detail = modes_bench.check_outputs(target, ref, [ref, ref], ids, 1e-5)
  assert ok and detail["identical"] == 2
  wrong = [list(ref[0]), list(ref[1])]
  wrong[1][3] = (wrong[1][3] + 1) % target.config.vocab_size
  ok, detail = modes_bench.check_outputs(target, ref, [ref, wrong], ids, 1e-5)
  assert not ok
  assert detail[1]["mismatched"] == 1 and detail[1]["details"][0]["index"] == 3


def test_mode_k_steps_pairs_the_two_run_length_logs():
  modes = [["ar", 3], ["sequential", 20], ["ar", 2], ["parallel", 5], ["sequential", 4]]
  ks = [[4, 16], [2, 4], [3, 5], [2, 4]]  # AR steps have no k entry
  assert modes_bench.mode_k_steps(modes, ks) == [
      ["ar", 0, 5], ["sequential", 4, 16], ["sequential", 2, 8], ["parallel", 3, 5]]


def test_fixed_settings_parse_and_fit_the_block():
  fixed = modes_bench.parse_fixed(["parallel:2", "sequential:8:target"])
  assert [(s.mode, s.verify_len, s.draft_dtype) for s in fixed] == [
      ("parallel", 2, "auto"), ("sequential", 8, "target")]
  settings = modes_bench.default_settings(fixed, ("auto", "target"))
  assert [s.name for s in settings] == ["ar", "flex", "flex:target", "parallel:2",
                                        "sequential:8:target"]
  kept, dropped = modes_bench.fit_settings(settings, 4)
  assert dropped == ["sequential:8:target"] and len(kept) == 4
  for bad in ("flex:4", "parallel:x", "sequential:1", "parallel"):
    try:
      modes_bench.parse_fixed([bad])
    except fd.FlexDraftError:
      continue
    raise AssertionError(bad)


def test_sampled_runs_are_timed_with_a_seed_per_round_and_not_compared():
  # At T > 0 outputs differ from AR's by design (the χ² tests check the
  # distribution): the bench times them, marks them "sampled", and each round
  # draws with its own seed.
  target = tiny_target()
  ids = [[5, 6, 7], [9, 10, 11, 12]]
  settings = modes_bench.default_settings([])  # ar, flex (AR steps: no drafter)
  settings = [s for s in settings if s.name == "ar"]
  result = modes_bench.run(target, None, ids, batch_sizes=[2], settings=settings,
                           max_new_tokens=6, repeats=2, temperature=1.0, log=lambda *a: None)
  row = result["results"][0]
  assert result["temperature"] == 1.0 and row["lossless"] is None
  assert row["settings"]["ar"]["lossless"] is True  # the reference itself
  md = modes_bench.markdown(result)
  assert "sampled at T = 1" in md and "| sampled |" in md
  greedy = modes_bench.run(target, None, ids, batch_sizes=[2], settings=settings,
                           max_new_tokens=6, repeats=1, log=lambda *a: None)
  assert greedy["results"][0]["lossless"] is True and "| yes |" in modes_bench.markdown(greedy)


def test_sampled_runs_draft_as_asked(monkeypatch):
  # draft_sampling reaches every call (None: auto) and the tables say argmax drafts.
  from flexdraft_jax import api
  target = tiny_target()
  seen, generate = [], api.generate
  monkeypatch.setattr(api, "generate", lambda *a, **k: seen.append(
      (k.get("mode"), k["sampling"].draft_sampling)) or generate(*a, **k))
  settings = [s for s in modes_bench.default_settings(modes_bench.parse_fixed(["sequential:2"]))
              if s.name in ("ar", "sequential:2")]
  drafter = random_drafter(target, block_size=4, noise=0.5)
  for asked, label in ((False, True), (None, False)):
    seen.clear()
    result = modes_bench.run(target, drafter, [[5, 6, 7], [9, 10]], batch_sizes=[2],
                             settings=settings, max_new_tokens=6, repeats=1,
                             temperature=1.0, draft_sampling=asked, log=lambda *a: None)
    assert seen and {ds for _, ds in seen} == {asked}
    assert result["draft_sampling"] is asked
    assert ("argmax drafts" in modes_bench.markdown(result)) == label
