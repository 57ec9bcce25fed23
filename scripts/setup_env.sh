#!/usr/bin/env bash
# Creates a virtual environment (if missing) with Paddle, paddleseg, psanet (editable) and
# the op; --serve adds the HTTP server's packages (requirements-serve.txt), --dev the test and
# ONNX tools and the server's. Idempotent.
#   PYTHON          the interpreter (default python3)
#   VENV            the environment's folder (default .venv)
#   PADDLE_PACKAGE  the Paddle wheel (default paddlepaddle==3.3.1; e.g. paddlepaddle-gpu==3.3.1)
#   PIP_CONSTRAINT  pip's own: e.g. a file holding numpy<2 to stay on numpy 1.x
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
REQUIREMENTS=(-r requirements.txt)
if [ "${1:-}" = "--dev" ]; then
  REQUIREMENTS=(-r requirements-dev.txt -r requirements-serve.txt)
elif [ "${1:-}" = "--serve" ]; then
  REQUIREMENTS=(-r requirements.txt -r requirements-serve.txt)
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
if ! python -c "import paddle" 2>/dev/null; then
  pip install -q "${PADDLE_PACKAGE:-paddlepaddle==3.3.1}"
fi
# paddleseg goes in without its dependencies (below). Once it is installed, pip checks its
# declared pins whenever it installs a package paddleseg depends on (visualdl with --dev)
# and reports opencv-python<=4.6 as a conflict: so when the requirements install anything,
# paddleseg is taken out first and put back after.
NEW=$(pip install --dry-run -q --report - "${REQUIREMENTS[@]}" 2>/dev/null \
  | python -c 'import json, sys; print(len(json.load(sys.stdin)["install"]))' 2>/dev/null || echo 1)
if [ "$NEW" != 0 ] && pip show -q paddleseg 2>/dev/null; then
  pip uninstall -q -y paddleseg
fi
pip install -q "${REQUIREMENTS[@]}"
# paddleseg without its stale pins (opencv-python<=4.6, so numpy<2): requirements.txt
# lists what it imports.
pip install -q --no-deps -r requirements-paddleseg.txt
# psanet itself, editable: `import psanet` from any folder in this venv, the code of this
# checkout; the op stays the just-in-time build below (setup.py builds none for -e).
pip install -q --no-build-isolation --no-deps -e .
# Build the op once now rather than inside the first test or training run.
python -c "from psanet.ops import load_library; print('psa_mask op:', load_library())" 2>&1 \
  | grep -v -i -e 'ccache' -e 'warnings.warn'
