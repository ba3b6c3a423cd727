#!/usr/bin/env bash
# The test command: makes .venv (once), installs the project into it, runs pytest.
# Extra arguments go to pytest, e.g. `bash launch/test.sh -k decoding`.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
bash launch/setup.sh --test
python -m pytest -q "$@"
