#!/usr/bin/env bash
# Sets up .venv and runs the test suite (README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --dev
. .venv/bin/activate
python -m pytest -q tests "$@"
