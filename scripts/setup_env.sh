#!/usr/bin/env bash
# Creates .venv (if missing) with Paddle, paddleseg and the op; --dev adds the test and
# ONNX tools. Idempotent. PADDLE_PACKAGE overrides the Paddle wheel
# (e.g. PADDLE_PACKAGE=paddlepaddle-gpu==3.3.1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
REQUIREMENTS=requirements.txt
if [ "${1:-}" = "--dev" ]; then
  REQUIREMENTS=requirements-dev.txt
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import paddle" 2>/dev/null; then
  pip install -q "${PADDLE_PACKAGE:-paddlepaddle==3.3.1}"
fi
pip install -q -r "$REQUIREMENTS"
# Build the op once now rather than inside the first test or training run.
python -c "from psanet.ops import load_library; print('psa_mask op:', load_library())" 2>&1 \
  | grep -v -i -e 'ccache' -e 'warnings.warn'
