#!/bin/bash
# Session 11: under MXATTN_VARLEN_BWD_KERNEL=gluon both shards of tests/test_varlen_bwd.py ran into their 400 s
# timeout with empty logs. This runs each of its GPU tests in its own process under a short timeout, so that a
# hang names its test.  usage: PYTHONPATH=. bash scripts/diag_varlen_bwd_tests.sh [per-test seconds, default 90]
T=${1:-90}
export MXATTN_VARLEN_BWD_KERNEL=${MXATTN_VARLEN_BWD_KERNEL:-gluon}
PY=${MXATTN_PYTHON:-python3}
for t in $($PY -m pytest --collect-only -q -m gpu -p no:cacheprovider tests/test_varlen_bwd.py | grep "::"); do
  s=$(date +%s)
  timeout "$T" $PY -m pytest -m gpu -q -rfE -p no:cacheprovider "$t" > /tmp/diag_one.log 2>&1
  rc=$?
  echo "rc=$rc $(( $(date +%s) - s ))s $t: $(tail -1 /tmp/diag_one.log)"
  [ $rc -eq 0 ] || grep -E "^(E |FAILED)" /tmp/diag_one.log | head -8
done
