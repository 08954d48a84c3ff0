# Sourced by scripts/demo.sh and scripts/test.sh: finds or makes the Python environment mxattn runs in.
#
#   source scripts/env.sh "$@"    ->  $PY (the python to use), MXATTN_ARGS (the arguments minus --system)
#
# Which Python:
#   MXATTN_PYTHON=/path/to/python    that interpreter, as it is (no venv)
#   --system or MXATTN_NO_VENV=1     the system python3 (a GPU machine's environment), no venv
#   otherwise                        .venv in the repository root, created when missing
# PyTorch: when no torch >= 2.11 imports, installs $MXATTN_TORCH (default torch==2.13.0, which takes the CPU
# build where one lies in pip's find-links) before anything else, so that no requirement pulls a multi-GB CUDA build.
# mxattn: `pip install -e '.[test]'` into a venv (again only when pyproject.toml changed); with another Python,
# when its packages are all importable, the checkout is used through PYTHONPATH and nothing is installed (the
# GPU machine has no network).

MXATTN_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$MXATTN_ROOT"

MXATTN_ARGS=()
_mx_system=${MXATTN_NO_VENV:-0}
for _mx_a in "$@"; do
  if [ "$_mx_a" = "--system" ]; then _mx_system=1; else MXATTN_ARGS+=("$_mx_a"); fi
done

_mx_venv=0
if [ -n "${MXATTN_PYTHON:-}" ]; then
  PY=$MXATTN_PYTHON
elif [ "$_mx_system" = "1" ]; then
  PY=$(command -v python3)
else
  _mx_venv=1
  if [ ! -x .venv/bin/python ]; then
    echo "mxattn: creating .venv" >&2
    python3 -m venv .venv
  fi
  PY=$MXATTN_ROOT/.venv/bin/python
fi

_mx_has_torch() {
  "$PY" - <<'PYEOF' 2>/dev/null
import re, torch
major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
raise SystemExit(0 if (major, minor) >= (2, 11) else 1)
PYEOF
}

if ! _mx_has_torch; then
  echo "mxattn: installing ${MXATTN_TORCH:-torch==2.13.0} into $PY" >&2
  "$PY" -m pip install --disable-pip-version-check -q "${MXATTN_TORCH:-torch==2.13.0}"
fi

if [ "$_mx_venv" = "1" ]; then
  _mx_stamp=.venv/.mxattn-installed
  _mx_want=$(cksum < pyproject.toml)
  if [ ! -f "$_mx_stamp" ] || [ "$(cat "$_mx_stamp")" != "$_mx_want" ] || ! "$PY" -c "import mxattn" 2>/dev/null; then
    echo "mxattn: pip install -e '.[test]'" >&2
    "$PY" -m pip install --disable-pip-version-check -q -e '.[test]'
    echo "$_mx_want" > "$_mx_stamp"
  fi
elif ! "$PY" -c "import torch, numpy, tqdm, matplotlib, pytest, hypothesis" 2>/dev/null; then
  echo "mxattn: pip install -e '.[test]' into $PY" >&2
  "$PY" -m pip install --disable-pip-version-check -q -e '.[test]'
fi
export PYTHONPATH="$MXATTN_ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset _mx_a _mx_system _mx_venv _mx_stamp _mx_want
