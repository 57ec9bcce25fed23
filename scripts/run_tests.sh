#!/usr/bin/env bash
# Sets up .venv and runs the test suite (README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --dev
. "${VENV:-.venv}/bin/activate"
# pytest-timeout ends a test that hangs (and prints its stacks) rather than CI.
python -m pytest -q --timeout 1200 --timeout_method thread tests "$@"
