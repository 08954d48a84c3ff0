#!/usr/bin/env bash
# Nsight Compute of the Gluon forward on FP8 operands, the real build and the no-softmax probe (MXATTN_FWD_PROBE=4),
# B2 H16 S8192 d128 non-causal: warp stalls, issue slots, pipe use, so that the products' chain's idle time has
# names (docs/perf-notes-attn-fwd-gluon.md, session 16).   PYTHONPATH=. bash scripts/ncu_fwd_probe.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: ncu_fwd_probe.sh OUTDIR}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for probe in 0 4; do
  MXATTN_FWD_PROBE=$probe timeout "${NCU_TIMEOUT:-150}" "$NCU" --clock-control none --kernel-name regex:"_attn_fwd_ws_kernel" \
    --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section InstructionStats --section ComputeWorkloadAnalysis --metrics \
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
    python3 -c "
import torch
from mxattn.kernels.attn_fwd_gluon import attn_fwd_gluon
from mxattn.kernels.quantize import row_scaled_triton
x = [torch.randn(2, 8192, 16, 128, device='cuda', dtype=torch.bfloat16) for _ in range(3)]
q, k, v = row_scaled_triton(x[0], 'q'), row_scaled_triton(x[1], 'k'), row_scaled_triton(x[2], 'v')
for _ in range(2):
    attn_fwd_gluon(q, k, v, causal=False)
torch.cuda.synchronize()
" > "$OUT/ncu_fwd_probe$probe.txt" 2>&1
  echo "== probe $probe (rc $?)"
  grep -E "Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|hmma|pipe_xu|Executed Ipc" \
    "$OUT/ncu_fwd_probe$probe.txt" | head -40
done
