#!/usr/bin/env bash
# The TPU compile tier: the tests that compile for a TPU without one (tests/test_aot.py),
# with the real TPU compiler. Makes .venv-tpu (once), a venv of its own so the main test
# environment stays CPU-only, installs the project, pytest and jax[tpu] (libtpu, for the
# jax version the project installs; no TPU needed), and runs them.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-tpu/bin/python ]; then
  python3 -m venv .venv-tpu
fi
. .venv-tpu/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -e . pytest
python -m pip install -q "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"
# libtpu present and no TPU: the tests pick their TPU topologies themselves
JAX_PLATFORMS=cpu python -m pytest -q tests/test_aot.py "$@"
