#!/usr/bin/env bash
# Sets up .venv and runs the test suite (README's test command).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh --dev
. "${VENV:-.venv}/bin/activate"
# pytest-xdist: one worker per CPU, at most 4 (each holds a Paddle and the servers its tests
# start), a test file's tests on one worker (its module fixtures made once);
# PSANET_TEST_WORKERS=0 runs them in this process. pytest-timeout ends a test that hangs (and
# prints its stacks) rather than CI.
cpus=$(python -c 'import os; print(len(os.sched_getaffinity(0)))')
workers=${PSANET_TEST_WORKERS:-$(( cpus < 4 ? cpus : 4 ))}
python -m pytest -q --timeout 1200 --timeout_method thread -n "$workers" --dist loadfile tests "$@"
