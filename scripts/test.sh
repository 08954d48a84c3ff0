#!/usr/bin/env bash
# Set up (scripts/env.sh: .venv, torch, mxattn) and run the test suite; arguments go to pytest.
#   bash scripts/test.sh [--system] [pytest args ...]
set -euo pipefail
source "$(dirname "$0")/env.sh" "$@"
exec "$PY" -m pytest -q "${MXATTN_ARGS[@]}"
