#!/usr/bin/env bash
# Set up (scripts/env.sh: .venv, torch, mxattn) and run `mxattn demo`; arguments go to the demo.
#   bash scripts/demo.sh [--system] [--quick] [--out DIR] [--device cpu|cuda] ...
set -euo pipefail
source "$(dirname "$0")/env.sh" "$@"
exec "$PY" -m mxattn demo "${MXATTN_ARGS[@]}"
