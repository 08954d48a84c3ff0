#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, benchmarks, results as JSON/PNG under OUTDIR.
#   PYTHONPATH=. bash scripts/gpu_check.sh OUTDIR [stage ...]
# stages: env tests tune bench accuracy quant (default: env tests bench accuracy quant)
# Needs no network: uses the machine's python3 (torch >= 2.11, triton >= 3.6) and the packages it has.
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUTDIR [stage ...]}
shift || true
STAGES=${*:-env tests bench accuracy quant}
mkdir -p "$OUT"
PY=${MXATTN_PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
status=0
for st in $STAGES; do
  echo "=== stage $st ($(date +%T))"
  case $st in
    env)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/env.txt"
      $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/env.txt" ;;
    tests)
      $PY -m pytest -m gpu -q -rfE -x --maxfail=10 -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 || status=1 ;;
    tests-all)
      $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -60 || status=1 ;;
    tune)
      $PY benchmarks/tune_attn_fwd.py --out "$OUT" ${TUNE_ARGS:-} || status=1 ;;
    bench)
      $PY -m mxattn bench --out "$OUT" ${BENCH_ARGS:-} || status=1 ;;
    accuracy)
      $PY -m mxattn accuracy --out "$OUT" ${ACCURACY_ARGS:-} || status=1 ;;
    quant)
      $PY -c "
import json, sys
from mxattn.bench.quantize_bench import run_quantize_bench
from mxattn.bench.results import write_result
rows = run_quantize_bench()
print(json.dumps(rows, indent=1))
print(write_result('quantize', rows, sys.argv[1]))
" "$OUT" || status=1 ;;
    *) echo "unknown stage $st"; status=1 ;;
  esac
done
exit $status
