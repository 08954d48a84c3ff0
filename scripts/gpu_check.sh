#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, benchmarks, results as JSON/PNG under OUTDIR.
#   MXATTN_COMMIT=<sha> PYTHONPATH=. bash scripts/gpu_check.sh OUTDIR [stage ...]
# Stages (default: env tests bench quant):
#   env        GPU, clocks, versions
#   tests      every `gpu`-marked test except the Gluon forward's and the Gluon linear's (which could hang on a barrier
#              bug; stages gluon and lineargluon)
#   gluon      the warp-specialized Gluon forward: compile check, small tests, all tests, speed vs tl and cuDNN
#   bwd        backward kernels vs SDPA (python -m mxattn.kernels.attn_bwd)
#   bwdgluon   the Gluon dQ / dK-dV backward kernels: compile checks, small cases under a timeout, all GPU tests
#   lineargluon  the Gluon linear + MXFP8 quantize: compile check, tiny cases under a timeout, its GPU tests, the
#              linear_quant GPU tests, bench_producers (gluon / tl / cuBLAS FP8 rows)
#   lineartiles  the Gluon linear's tile widths (perf-notes-producers.md, session 14): the compile check of the new
#              variants and a warm-up of the bench's kernels beside the GPU tests (tiny cases first, one process per
#              config under a short timeout: a config that fails or hangs there is skipped from then on; then one
#              process per config), then scripts/bench_linear_tiles.py (block_n 128 / 256 configs beside
#              cuBLAS FP8 and BF16 + quantize, M 16k K 4096 N 4096 / 12288, hdim / both): a table on stdout,
#              linear_tiles.json and linear_tiles_tests.log (~5 min)
#   host       scripts/host_timing.py: host us per call of each layer (launch overhead): host_timing JSON + .txt
#   bwdsweep   backward tile sweep (SWEEP_CONFIGS) at S 8k, kernels only
#   profile    scripts/profile_attn.py: kernel-by-kernel device time of one public call, fwd and fwd+bwd, vs cuDNN
#   bench      `mxattn bench`: forward/backward vs SDPA cuDNN/flash BF16, JSON + PNG
#   accuracy   `mxattn accuracy` with the GPU kernel row
#   quant      quantization kernels vs device copy
#   quantcmp   session 13 of docs/perf-notes-quantize.md: the GPU tests of what it changed (eight pytest processes
#              side by side), the bench rows QUANT_ROWS of a base tree and of this tree in the same call (QUANT_BASE,
#              default _base: a directory holding another commit's mxattn, e.g. `git archive main mxattn | tar -x -C
#              _base`; skipped when absent), then the tile sweep of the kinds QUANT_SWEEP at d128 and d64:
#              quantize_cmp.json, quantize_cmp_sweep.json, quant_tests_*.log
#   quant14    session 14 of docs/perf-notes-quantize.md (V's exponent passes, the no-grad forward's fused launches):
#              its GPU tests (six pytest processes side by side, QUANT14_TEST_TIMEOUT s each, one log), the rows of
#              scripts/quant_s14.py for a base tree (QUANT_BASE, default _base, skipped when absent) and this tree
#              in the same call, then the session's sweeps; prints one table: quant14_tests.txt, quant14_cmp.json,
#              quant14_sweep.json (QUANT_TESTS=0 / QUANT_BENCH=0 / QUANT_SWEEP=0 skip a part)
#   quant16    session 16: V's scales-first pass 1 from MX (its GPU tests, then data-first vs scales-first side by
#              side), then every kernel issue 3 names at d128 / d64 on this tree's defaults: quant16_*.json / .txt
#   quant16b   session 16: V's pass-2 tiles from MX (GPU tests, then scripts/quant_s14.py tiles: mx_seq_v at d128 /
#              d64, dequant_seq at larger tiles, the seq kernels at d64): quant16b_tests.txt, quant16b_tiles.json
#   quant16c   session 16: V's pass 2 from MX on rows of channels (MX_SEQ_V_ROWS): GPU tests, then
#              scripts/quant_s14.py vrows: quant16c_tests.txt, quant16c_rows.json
#   producers  rmsnorm_quant / linear_quant vs unfused and cuBLAS FP8
#   rmsnormrows  rmsnorm_quant's row-set kernel (perf-notes-producers.md, session 12): every rmsnorm GPU test as four
#              processes side by side (grouped by tile: each builds only its kernels), then bench_producers with
#              the row-set tiles (producers.ROWSET_TILES) beside the defaults, rmsnorm only, alone on the GPU
#   rmsnormblocks  rmsnorm_quant's token-block seq / both kernel (perf-notes-producers.md, session 17): its tests on
#              the GPU, then bench_producers with its tiles beside the defaults (RMS_TIMINGS: graph, eager)
#   varlen     jagged forward vs the dense kernel at 50 % fill
#   varlensweep  the same over several length draws, d128 and d64, and d64 tile configs
#   varlenbwd  jagged backward (Gluon jagged mode, the Hopper default, asked here by name: compile checks, tiny cases, its GPU
#              tests) vs the dense default backward (Gluon on Hopper), the tl jagged path and SDPA, two draws
#   fuseddq    the fused-dQ backward (GluonDkdvConfig.fuse_dq, opt-in): compile check, its GPU tests (tiny first),
#              scripts/bench_fused_dq.py (kernels and public backward vs the split kernels and SDPA cuDNN, one run)
#              (FUSED_DQ_K narrows the tests, FUSED_DQ_BENCH=0 skips the bench; stage fuseddqbench: the bench alone)
#   qkvchain   the fused chain rmsnorm_quant -> qkv_proj -> mxfp8_attn_func vs the BF16 chain: time, peak memory
#   fwdprobe   the Gluon forward's cost split: scripts/probe_fwd_gluon.py per MXATTN_FWD_PROBE build (no exp2, no O
#              rescale, no row max, no softmax) beside the real one, timing only: OUTDIR/fwd_probe.jsonl
#   bwdprobe   the Gluon dK/dV step's cost split: scripts/probe_bwd_gluon.py per MXATTN_DKDV_PROBE build (no exp2, no
#              dS exponent) beside the real one, timing only: OUTDIR/bwd_probe.jsonl
#   lpt        causal CTA order (MXATTN_CAUSAL_LPT): the bit-identity tests (dQ, dK/dV, the tl and Gluon forwards), then
#              dkdv, dq, fwd-gluon and the public backward with the variable 0 / 1 in turns (bench_env_turns.py;
#              LPT_KERNELS, LPT_ARGS)
#   lptfwd     the forwards' causal CTA order: bit-identity tests, then the Gluon forward persistent against
#              per-block + causal_lpt, and the tl forward with MXATTN_CAUSAL_LPT 0 / 1 (bench_env_turns.py)
#   dqprobe    the fused dQ's cost split: scripts/probe_fused_dq.py per MXATTN_DQ_PROBE build (no dS store, adds
#              without traffic, exponent only) beside the real one, timing only: OUTDIR/dq_probe.jsonl
#   varlenbwdtime  varlenbwd's timing rows alone (B16 H16 d128, mean length 2048; VARLEN_BWD_SEEDS, default "0 1"):
#              per row ms of each path, parts_ms (preprocessing, tile tables, each Gluon launcher) and host_ms
#   graph      `mxattn bench --cuda-graph`: forward and backward as CUDA-graph replays (no host launch overhead), S 2k/4k
#              (GRAPH_ARGS), after the test that replays equal the eager gradients
#   bwdfold    δ's launch writing the dK/dV step rows (session 21): its GPU tests, then the backward's host rows
#   steprows   the δ launch's step rows against _step_rows' kernel, bit for bit (session 22)
#   eagergap   scripts/eager_gap.py: eager against graph at S 2k (host time, a sleep probe for syncs, allocations)
#   ring       ring attention over every GPU (torchrun, nccl): check against single-GPU mxattn, then timing
#   train      examples/train_gpt.py (TRAIN_ATTENTION=sdpa|mxfp8|both, TRAIN_ARGS), into OUTDIR/train
#   trainpar   both halves of the parity run at once, sdpa on GPU 0 and mxfp8 on GPU 1 (needs 2 GPUs), then parity.json
#   blockscaled  the Blackwell-path forward (tl.dot_scaled, upcast to bf16 on Hopper) vs the Hopper kernel, B2 H16 S4k
#   fwdtimeline  the Gluon forward's timing probe (scripts/fwd_timeline.py): per-CTA Q wait, KV loop per tile,
#              output, CTA gaps per SM; OUTDIR/fwd_timeline*.json
#   fwd18      timing of session 18's forward variants (persistent Gluon kernel, exp2_fma; tests/test_attn_fwd_gluon.py
#              --persistent --exp2-fma) into OUTDIR/fwd18.json
#   fwdmask    session 19: the Gluon forward's lean masked-tile arithmetic: compile check, GPU tests, bench
#   bwdrows    session 19: the Gluon backward's row-wise epilogue stores (MXATTN_BWD_OUT_ROWS): builds, tests, timing;
#              session 20: its tests include the query- / key-permuted boxes' bit-identity tests (q_perm, k_perm, on
#              by default) and its timing rows the 2-D builds (dkdv_2d_ms, dq_2d_ms)
#   bwdpersistent  session 20: the persistent dK/dV kernel (opt-in): builds, bit-identity tests, timing
#   dqslots    session 23: the dQ step with fewer barriers (amax_slots): bit-identity tests, timing
#   bwdbase    session 20: a base tree's backward kernels (BWD_BASE, default _s19base) against this tree's, in turns
#   outrows    session 19: the Gluon forward's row-wise output store: compile check, GPU tests, timing probe, bench
#   exp2fma    the forward kernels with part of their exp2 on the FMA pipe (exp2_fma of GluonFwdConfig / FwdConfig,
#              session 18): compile
#              check, its GPU tests (Gluon and tl: config variants, against the MUFU-only kernel, the split), then
#              tests/test_attn_fwd_gluon.py --exp2-fma (B2 H16 d128/d64 S 2k/8k, both causal flags) into
#              OUTDIR/gluon_exp2_fma.json
#   ncu        Nsight Compute counters of the Gluon forward and backward kernels (NCU_SHAPE="B H S D causal", default
#              2 16 8192 128 1: the API takes the Gluon forward at d128 S >= 8k), into OUTDIR/ncu_bwd.txt
#   sanitize   compute-sanitizer memcheck/racecheck/synccheck on tiny shapes (scripts/sanitize.sh; slow: run alone)
# Needs no network: the machine's python3 (torch >= 2.11, triton >= 3.6). Each stage runs under a timeout
# (MXATTN_STAGE_TIMEOUT seconds, default 420) so that one hang cannot eat the whole lease. The GPU machine has
# no .git: set MXATTN_COMMIT so results name the commit they measured.
set -uo pipefail
OUT=${1:?usage: gpu_check.sh OUTDIR [stage ...]}
shift || true
STAGES=${*:-env tests bench quant}
mkdir -p "$OUT"
PY=${MXATTN_PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
T=${MXATTN_STAGE_TIMEOUT:-420}
unset MXATTN_TEST_SHARD  # set per test process below ("file@n", bwdgluon), never for the whole script
status=0
# one pytest process over tests/test_quantize_kernels.py -k "$2" (QUANT16_TEST_TIMEOUT s): OUT/$1_tests.txt, its tail
# printed, status 1 on a failure
quant_gpu_tests() {
  ( timeout "${QUANT16_TEST_TIMEOUT:-150}" $PY -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider \
      tests/test_quantize_kernels.py -k "$2"; echo "## rc $?" ) > "$OUT/$1_tests.txt" 2>&1
  tail -5 "$OUT/$1_tests.txt"
  grep -qE "^(FAILED|ERROR)|## rc [1-9]" "$OUT/$1_tests.txt" && status=1
}
# pytest_groups NAME MARK GROUP...: tests/test_producers.py as one pytest process per -k GROUP, side by side (MARK:
# extra pytest arguments, "-m gpu" or ""), logs OUT/NAME_i.txt, their tails printed, status 1 on a failure
pytest_groups() {
  local name=$1 mark=$2 i=0 pids=() g f
  shift 2
  for g in "$@"; do
    i=$((i + 1))
    ( export OMP_NUM_THREADS=4; echo "-k $g"
      run $PY -m pytest $mark -q -rfE -p no:cacheprovider tests/test_producers.py -k "$g"
      echo "exit $status" ) > "$OUT/${name}_$i.txt" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for f in "$OUT"/"$name"_*.txt; do
    echo "--- $f"; tail -n 6 "$f"; grep -q "^exit 0$" "$f" || status=1
  done
}
# MXATTN_DEADLINE (epoch seconds) caps every command so that the call's last results still get written.  run returns
# the command's status as well as setting status=1: inside a pipeline (its own subshell) the assignment is lost, so
# "run ... | tail || status=1" (pipefail) is what records a failure there
run() {
  local t=$T rc
  if [ -n "${MXATTN_DEADLINE:-}" ]; then
    local left=$((MXATTN_DEADLINE - $(date +%s)))
    [ "$left" -lt "$t" ] && t=$left
    [ "$t" -le 5 ] && { echo "!! deadline reached, skipped: $*"; status=1; return 1; }
  fi
  timeout "$t" "$@" || { rc=$?; echo "!! stage command failed or timed out (rc=$rc): $*"; status=1; return $rc; }
}
for st in $STAGES; do
  echo "=== stage $st ($(date +%T))"
  case $st in
    env)
      nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/env.txt"
      $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/env.txt" ;;
    tests)
      # one pytest process per test file, MXATTN_TEST_JOBS at a time (Triton compiles on the CPU cores in parallel);
      # MXATTN_TEST_K / MXATTN_TEST_FILES narrow the run ("file@n": that file as n processes, each every n-th test).
      # Logs are joined into gpu_tests.log, summary lines printed.
      mkdir -p "$OUT/tests"
      # the Gluon kernels' own test files run in their stages (gluon, lineargluon), tiny cases first under a short
      # timeout; other files reach Gluon kernels through the API (the backward, linear_quant in test_producers.py),
      # where a hang is bounded by the per-file timeout T
      files=${MXATTN_TEST_FILES:-$(ls tests/test_*.py | grep -v -e test_attn_fwd_gluon.py -e test_linear_gluon.py)}
      # tests that measure something (memory at S 16k/32k) write their rows to $OUT
      # MXATTN_FAST_LAUNCH=check: the fast launch path checked against Triton's own dispatch on every launch
      # (mxattn/kernels/launch.py); set for the tests only, not the stages that time
      # "file@n": the file as n processes, each every n-th test (MXATTN_TEST_SHARD, tests/conftest.py)
      jobs=$(for f in $files; do
        case $f in
          *@*) n=${f##*@}
               if [[ $n =~ ^[1-9][0-9]*$ ]]; then for ((i = 0; i < n; i++)); do echo "${f%@*}@$i/$n"; done
               else echo "!! bad shard count in $f (want file@n, n >= 1)" >&2; echo "$f@bad"; fi ;;
          *) echo "$f" ;;
        esac
      done)
      printf '%s\n' $jobs | MXATTN_FAST_LAUNCH=${MXATTN_FAST_LAUNCH:-check} MXATTN_RESULTS_DIR="$OUT" T=$T PY=$PY K="${MXATTN_TEST_K:-}" D="$OUT/tests" xargs -P "${MXATTN_TEST_JOBS:-6}" -I{} \
        bash -c 'j={}; f=${j%@*}; sh=; [ "$f" = "$j" ] || sh=${j##*@}; n=$(basename "$f" .py)${sh:+-${sh/\//of}};
                 MXATTN_TEST_SHARD=$sh timeout $T $PY -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider "$f" ${K:+-k "$K"} \
                 >"$D/$n.log" 2>&1; rc=$?; echo "$n rc=$rc: $(tail -1 "$D/$n.log")"; [ $rc -eq 0 ] || [ $rc -eq 5 ]' \
        || status=1
      cat "$OUT"/tests/*.log > "$OUT/gpu_tests.log"; rm -rf "$OUT/tests"
      grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -60 ;;
    fwdtimeline)
      # where a Gluon forward CTA spends its time (the TIMES probe, session 18): Q wait, KV loop per tile, output,
      # CTA gaps per SM, at B2 H16 d128 S 2k / 4k / 8k, non-causal then causal, into OUTDIR/fwd_timeline*.json
      run $PY scripts/fwd_timeline.py --out "$OUT/fwd_timeline.json"
      run $PY scripts/fwd_timeline.py --causal --out "$OUT/fwd_timeline_causal.json"
      # the default kernel (session 19: persistent, row-wise store): one record per work item, gaps between items
      run $PY scripts/fwd_timeline.py --persistent --out-store rows --out "$OUT/fwd_timeline_persistent.json"
      run $PY scripts/fwd_timeline.py --persistent --out-store rows --causal --out "$OUT/fwd_timeline_persistent_causal.json" ;;
    outrows)
      # session 19: the Gluon forward's output stored as whole rows (GluonFwdConfig.out_store="rows"): compile
      # check, its GPU tests (bit-identical to the default store, per-block and persistent), the timing probe of
      # both stores, then the bench (per-block / persistent x mma / rows, 3 repeats taking turns): fwd_out_rows*.json
      run $PY scripts/compile_check_gluon.py --only d128_nopingpong,d64_causal_nopingpong --out-store rows
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_attn_fwd_gluon.py -k "rows" 2>&1 | tail -15 || status=1
      run $PY scripts/fwd_timeline.py --out-store mma,rows --out "$OUT/fwd_out_rows_timeline.json"
      run $PY tests/test_attn_fwd_gluon.py --out-store --repeats 3 ${OUTROWS_ARGS:-} --out "$OUT/fwd_out_rows.json" ;;
    fwd18)
      # session 18's forward builds, timing only (their tests: the tests stage with MXATTN_TEST_FILES=
      # "tests/test_attn_fwd_gluon.py@4 tests/test_attn_fwd.py" MXATTN_TEST_K="exp2 or persistent"): the Gluon
      # kernel and its persistent / exp2_fma variants, the tl kernel and its exp2_fma variants, SDPA cuDNN BF16,
      # B2 H16 d128 / d64 S 2k / 8k both causal flags, into OUTDIR/fwd18.json
      run $PY tests/test_attn_fwd_gluon.py --persistent --exp2-fma --out "$OUT/fwd18.json" ;;
    exp2fma)
      run $PY scripts/compile_check_gluon.py --only d128_nopingpong,d64_causal_nopingpong --exp2-fma 50
      run $PY -m pytest -q -rfE -p no:cacheprovider tests/test_attn_fwd_gluon.py tests/test_attn_fwd.py -k "exp2" 2>&1 | tail -15 || status=1
      run $PY tests/test_attn_fwd_gluon.py --exp2-fma --out "$OUT/gluon_exp2_fma.json" ;;
    gluon)
      run $PY scripts/compile_check_gluon.py --only d128
      run $PY -m pytest -m gpu -q -x -rfE -p no:cacheprovider tests/test_attn_fwd_gluon.py -k "1x1x1x2x2x128 or 2x113x203"
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_attn_fwd_gluon.py 2>&1 | tee "$OUT/gluon_tests.log" | tail -30 || status=1
      run $PY tests/test_attn_fwd_gluon.py --quick --sweep --out "$OUT/gluon_vs_tl.json" ;;
    bwd)
      run $PY -m mxattn.kernels.attn_bwd --out "$OUT" ;;
    lineargluon)
      # the Gluon linear + MXFP8 quantize kernel (linear_quant's default on Hopper): compile check, tiny cases under
      # a short timeout first (a barrier bug hangs rather than fails), all its GPU tests, then the producers
      # benchmark (rows mxattn_gluon / mxattn_gluon_inline / mxattn_tl / cuBLAS FP8 side by side)
      run $PY scripts/compile_check_linear_gluon.py
      T=120 run $PY -m pytest -m gpu -q -x -rfE -p no:cacheprovider tests/test_linear_gluon.py -k tiny
      run $PY -m pytest -m gpu -q -rfE -s -p no:cacheprovider tests/test_linear_gluon.py \
        2>&1 | tee "$OUT/linear_gluon_tests.log" | tail -40
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_producers.py -k linear
      run $PY -c "import sys; from mxattn.producers import bench_producers; print(bench_producers(outdir=sys.argv[1]))" "$OUT" ;;
    lineartiles)
      # CPU-side work runs beside the tests: the compile check (new variants) and one call of each bench kernel
      # (compiles into Triton's cache, so the timed run compiles nothing); their output is printed, not kept.
      # Tiny cases first, one process per config under a short timeout (a barrier bug hangs rather than fails): a
      # config whose tiny case fails or hangs is left out of its other tests, the warm-up and the bench.
      nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv,noheader
      $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
      tmp=$(mktemp -d)
      T=240 run $PY scripts/compile_check_linear_gluon.py \
        --only hdim_fast,both_fast,hdim_wide,both_wide,hdim_wide_epi,both_wide_epi,hdim_wide_epi2,both_wide_epi2 \
        > "$tmp/compile.txt" 2>&1 &
      # config: its -k among the tile tests (ids end in the config name) and its bench row
      declare -A lt_k=([default]="gluon_tiny and both and not inline" [fast128]="fast128" [n64]="n64"
                       [wide]="wide and not wide_epi" [wide_epi]="wide_epi and not wide_epi2" [wide_epi2]="wide_epi2")
      declare -A lt_row=([default]=gluon128_precise [fast128]=gluon128_fast [n64]=
                         [wide]=gluon256_inline [wide_epi]=gluon256_epi [wide_epi2]=gluon256_epi2)
      lt_cfgs="default fast128 n64 wide wide_epi wide_epi2"
      for c in $lt_cfgs; do
        kk="(tiles_tiny and (${lt_k[$c]}))"; [ "$c" = default ] && kk=${lt_k[$c]}
        ( T=150 run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_linear_gluon.py -k "$kk" \
            > "$tmp/tiny.$c.log" 2>&1; tail -1 "$tmp/tiny.$c.log" | grep -q " passed" \
            && ! grep -q "^!! stage command failed" "$tmp/tiny.$c.log" && touch "$tmp/ok.$c" ) &
      done
      wait
      skip=""
      for c in $lt_cfgs; do
        echo "tiny $c: $(grep -E "[0-9]+ (passed|failed|errors?)( |,|$)" "$tmp/tiny.$c.log" | tail -1)"
        [ -f "$tmp/ok.$c" ] || { echo "!! $c: tiny case failed or hung; its tests and bench row are skipped"; status=1
                                 grep -hE "^(FAILED|ERROR)" "$tmp/tiny.$c.log" | head -5; skip="$skip,${lt_row[$c]}"; }
      done
      T=200 run $PY scripts/bench_linear_tiles.py --warm-only --skip "$skip" > "$tmp/warm.txt" 2>&1 &
      # one process per config (each compiles only its kernels); the special-values test rides with wide_epi2, the
      # default (precise, 128) on the N tails with n64 (the epilogue now skips the parts past N)
      for c in fast128 n64 wide wide_epi wide_epi2; do
        [ -f "$tmp/ok.$c" ] || continue
        kk="(tiles and not tiny and (${lt_k[$c]}))"
        [ "$c" = n64 ] && [ -f "$tmp/ok.default" ] && kk="$kk or (gluon_matches_tl and both and not inline)"
        [ "$c" = wide_epi2 ] && [ -f "$tmp/ok.wide" ] && [ -f "$tmp/ok.wide_epi" ] && kk="$kk or tiles_special_values"
        { echo "## $c: -k $kk"
          T=200 run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_linear_gluon.py -k "$kk"
        } > "$tmp/tests.$c.log" 2>&1 &
      done
      wait
      cat "$tmp"/tiny.*.log "$tmp"/tests.*.log > "$OUT/linear_tiles_tests.log" 2>/dev/null
      for f in "$tmp"/tests.*.log; do [ -f "$f" ] && echo "$(head -1 "$f"): $(tail -1 "$f")"; done
      grep -hE "^(FAILED|ERROR|!!)" "$tmp"/tests.*.log 2>/dev/null | head -20
      grep -E "^!!|^== |registers|spills|shared memory|consumer loop|all variants|FAILED|ERROR" "$tmp/compile.txt" \
        | sed -E 's/;  *(UIADD3|USHF|UMOV).*//' | cut -c1-170
      grep -E "^!!|warm" "$tmp/warm.txt" | tail -14
      rm -rf "$tmp"
      T=170 run $PY scripts/bench_linear_tiles.py --skip "$skip" --out "$OUT/linear_tiles.json" ;;
    bwdgluon)
      # the warp-specialized Gluon backward kernels (the API's default on Hopper; the split dK/dV variant opt-in):
      # compile checks (both dK/dV builds), two small cases
      # under a short timeout first (a barrier bug hangs rather than fails), then all their GPU tests and timings
      for part in dq dkdv; do
        [ -f "tests/test_attn_bwd_${part}_gluon.py" ] || continue
        run $PY "scripts/compile_check_bwd_${part}_gluon.py"
        run $PY "scripts/compile_check_bwd_${part}_gluon.py" --split
        # dK/dV: the dS exponent per tile too (the rule before session 8; the default is per key)
        [ "$part" = dkdv ] && run $PY scripts/compile_check_bwd_dkdv_gluon.py --split --ds-exp=tile
        T=120 run $PY -m pytest -m gpu -q -x -rfE -p no:cacheprovider "tests/test_attn_bwd_${part}_gluon.py" \
          -k "1x1x1x2x2x128c or 2x113x203 or key_exp_tiny or (bm128 and tiny)"
        # MXATTN_BWDGLUON_SHARDS processes per file side by side (the dK/dV file alone took > 560 s in one process)
        # (the tests that time something run after them, alone on the GPU)
        nsh=${MXATTN_BWDGLUON_SHARDS:-3}
        [[ $nsh =~ ^[1-9][0-9]*$ ]] || { echo "!! MXATTN_BWDGLUON_SHARDS=$nsh: want n >= 1; using 1"; nsh=1; status=1; }
        for ((i = 0; i < nsh; i++)); do
          MXATTN_TEST_SHARD=$i/$nsh run $PY -m pytest -m gpu -q -rfE -s -p no:cacheprovider -k "not bench" \
            "tests/test_attn_bwd_${part}_gluon.py" > "$OUT/bwd_${part}_gluon_tests.$i.log" 2>&1 &
        done
        wait
        run $PY -m pytest -m gpu -q -rfE -s -p no:cacheprovider -k bench "tests/test_attn_bwd_${part}_gluon.py" \
          > "$OUT/bwd_${part}_gluon_tests.bench.log" 2>&1
        cat "$OUT"/bwd_${part}_gluon_tests.*.log > "$OUT/bwd_${part}_gluon_tests.log"; rm -f "$OUT"/bwd_${part}_gluon_tests.*.log
        grep -E "passed|failed|^FAILED|^ERROR" "$OUT/bwd_${part}_gluon_tests.log" | tail -40
        grep -qE "^(FAILED|ERROR)|!! " "$OUT/bwd_${part}_gluon_tests.log" && status=1
      done
      # both through loss.backward() (MXATTN_BWD_KERNEL=gluon) against the tl kernels
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_attn_bwd.py -k "gluon_through_the_api"
      # the timings as one JSON: each Gluon kernel against its tl twin on the same operands
      run $PY scripts/bench_bwd_gluon_kernels.py "$OUT" ;;
    host)
      # host microseconds per call of each layer of the call stack, incl. a launch without the JIT's dispatch
      run $PY scripts/host_timing.py --out "$OUT" ${HOST_ARGS:-} | tee "$OUT/host_timing.txt" ;;
    bwdsweep)
      run $PY -m mxattn.kernels.attn_bwd --out "$OUT" --sweep ;;
    profile)
      run $PY scripts/profile_attn.py --out "$OUT" ${PROFILE_ARGS:-} ;;
    bench)
      run $PY -m mxattn bench --out "$OUT" ${BENCH_ARGS:-} ;;
    accuracy)
      run $PY -m mxattn accuracy --out "$OUT" ${ACCURACY_ARGS:-} ;;
    quant)
      run $PY -c "
import sys
from mxattn.bench.quantize_bench import run_quantize_bench, format_quantize_table
from mxattn.bench.results import write_result
rows = run_quantize_bench()
print(format_quantize_table(rows))
print(write_result('quantize', rows, sys.argv[1]))
" "$OUT" ;;
    quantcmp)
      # QUANT_TESTS=0 / QUANT_BENCH=0 / QUANT_SWEEP="" skip the tests / the base-vs-tree rows / the tile sweep
      i=0
      [ "${QUANT_TESTS:-1}" = 0 ] || {
      rs="test_gpu_row_scaled and not both and adversarial and (1000 or 4097 or 513)"
      for k in "test_gpu_dequantize_seq_words" "(test_gpu_dequantize and not seq_words) or test_gpu_from_mx_random_bytes" \
               "test_gpu_v_from_channel_major_mx" \
               "$rs and (rceil-q or floor-q)" "$rs and (rceil-k or floor-k)" \
               "(test_gpu_quantize_hdim and bfloat16 and (4097 or 2048)) or (test_gpu_even_tiles and 2048)" \
               "(test_gpu_quantize and not hdim and not blackwell and bfloat16) or (test_gpu_row_set_tiles and 1000)" \
               "test_gpu_quantize_blackwell_scale_layout"; do
        i=$((i + 1))
        run $PY -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider tests/test_quantize_kernels.py -k "$k" \
          >"$OUT/quant_tests_$i.log" 2>&1 &
      done
      wait
      for f in "$OUT"/quant_tests_*.log; do
        echo "$(basename "$f"): $(tail -1 "$f")"
        grep -qE "(failed|error|no tests ran)" <(tail -1 "$f") && status=1
        grep -E "^(FAILED|ERROR)" "$f" | head -20
      done
      }
      out_abs=$(cd "$OUT" && pwd)
      [ "${QUANT_BENCH:-1}" = 0 ] || {
      rows=${QUANT_ROWS:-quant_hdim quant_both rs_q rs_q_from_mx rs_k_from_mx rs_v_from_mx dequant_hdim dequant_seq
                    fwd_operands}
      rm -f "$out_abs/quantize_cmp.jsonl"
      for tree in "${QUANT_BASE:-_base}" .; do
        [ -d "$tree/mxattn" ] || { echo "!! no $tree/mxattn: its rows skipped"; continue; }
        code=$([ "$tree" = . ] && echo "${MXATTN_COMMIT:-this tree}" || echo "base $tree")
        # from inside the tree, so that its mxattn is the one imported
        (cd "$tree" && PYTHONPATH=. run $PY -c "
import json, sys
from mxattn.bench.quantize_bench import run_quantize_bench, format_quantize_table
rows = run_quantize_bench(kernels=sys.argv[3:])
print(format_quantize_table(rows))
with open(sys.argv[1], 'a') as f:
    f.writelines(json.dumps({**r, 'code': sys.argv[2]}) + chr(10) for r in rows)
" "$out_abs/quantize_cmp.jsonl" "$code" $rows)
      done
      $PY -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
json.dump(rows, open(sys.argv[2], 'w'), indent=1)
for r in rows:
    print(f\"{r['code'][:24]:<26}{r['kernel']:<16}D{r['D']:<5}{r['ms']:8.3f} ms {r['pct_of_copy']:6.1f} % of copy\")
" "$out_abs/quantize_cmp.jsonl" "$OUT/quantize_cmp.json" && rm -f "$out_abs/quantize_cmp.jsonl"
      }
      [ -z "${QUANT_SWEEP-mx_seq mx_hdim_k}" ] || run $PY -c "
import json, sys
from mxattn.bench.quantize_bench import SWEEP_PLAN, run_tile_sweep
plan = {k: SWEEP_PLAN[k] for k in sys.argv[2:]}
rows = [r for size in ((8, 8192, 16, 128), (16, 8192, 16, 64)) for r in run_tile_sweep(size, plan, vexp=())]
json.dump(rows, open(sys.argv[1], 'w'), indent=1)
" "$OUT/quantize_cmp_sweep.json" ${QUANT_SWEEP:-mx_seq mx_hdim_k} ;;
    quant14)
      out_abs=$(cd "$OUT" && pwd)
      [ "${QUANT_TESTS:-1}" = 0 ] || {
      i=0
      tt=${QUANT14_TEST_TIMEOUT:-110}
      for k in "test_gpu_v_exponent_min_tiles and t32x4" "test_gpu_v_exponent_min_tiles and not t32x4" \
               "test_gpu_forward_operands_k_launch or test_gpu_k_from_mx_groups" "test_gpu_v_exponent_from_mx and (t32x4 or t64x4)" \
               "test_gpu_v_exponent_from_mx and t128x4" \
               "test_gpu_v_exponent_pass or test_gpu_v_from_channel_major_mx or (test_gpu_row_scaled_both and 128)"; do
        i=$((i + 1))
        ( echo "## -k $k"; timeout "$tt" $PY -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider \
            tests/test_quantize_kernels.py -k "$k"; echo "## rc $?" ) >"$out_abs/q14_tests_$i.log" 2>&1 &
      done
      wait
      cat "$out_abs"/q14_tests_*.log > "$OUT/quant14_tests.txt" && rm -f "$out_abs"/q14_tests_*.log
      grep -E "^## -k|^## rc|passed|failed|^(FAILED|ERROR)" "$OUT/quant14_tests.txt" | grep -v "^tests/" | head -60
      grep -qE "^(FAILED|ERROR)|## rc [1-9]" "$OUT/quant14_tests.txt" && status=1
      }
      [ "${QUANT_BENCH:-1}" = 0 ] || {
      rm -f "$out_abs/q14_cmp.jsonl"
      q14=$(pwd)/scripts/quant_s14.py
      for tree in "${QUANT_BASE:-_base}" .; do
        [ -d "$tree/mxattn" ] || { echo "!! no $tree/mxattn: its rows skipped"; continue; }
        code=$([ "$tree" = . ] && echo "${MXATTN_COMMIT:-tree}" || echo "base")
        # from inside the tree, so that its mxattn is the one imported
        (cd "$tree" && PYTHONPATH=. run $PY "$q14" rows "$code" "$out_abs/q14_cmp.jsonl")
      done
      $PY -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
json.dump(rows, open(sys.argv[2], 'w'), indent=1)
" "$out_abs/q14_cmp.jsonl" "$OUT/quant14_cmp.json" && rm -f "$out_abs/q14_cmp.jsonl"
      }
      [ "${QUANT_SWEEP:-1}" = 0 ] || run $PY scripts/quant_s14.py sweep "$OUT/quant14_sweep.json"
      echo "--- quant14 table (code, kernel, shape, variant, ms, % of copy)"
      $PY scripts/quant_s14.py table "$OUT/quant14_cmp.json" "$OUT/quant14_sweep.json" ;;
    quant16)
      # session 16 (docs/perf-notes-quantize.md): the GPU tests of V's scales-first pass from MX (one process), then
      # data-first vs scales-first side by side, then every kernel issue 3 names on this tree's defaults
      [ "${QUANT_TESTS:-1}" = 0 ] || \
        quant_gpu_tests quant16 "scales_first or test_gpu_v_exponent_from_mx or test_gpu_v_from_channel_major_mx"
      run $PY scripts/quant_s14.py passes "$OUT/quant16_passes.json"
      [ "${QUANT16_ISSUE3:-1}" = 0 ] || run $PY scripts/quant_s14.py issue3 "$OUT/quant16_issue3.json" ;;
    quant16b)
      # session 16, second call: the GPU tests of V's pass-2 tiles, then the tile sweeps (scripts/quant_s14.py tiles)
      quant_gpu_tests quant16b "rescale_tiles"
      run $PY scripts/quant_s14.py tiles "$OUT/quant16b_tiles.json" ;;
    quant16c)
      # session 16, third call: V's pass 2 on rows of channels (MX_SEQ_V_ROWS): its GPU tests, then the sweep
      quant_gpu_tests quant16c "rescale_rows"
      run $PY scripts/quant_s14.py vrows "$OUT/quant16c_rows.json" ;;
    producers)
      run $PY -c "import sys; from mxattn.producers import bench_producers; print(bench_producers(outdir=sys.argv[1]))" "$OUT"
      # PRODUCERS_SWEEP=1: rmsnorm_quant forward tiles (rows per program, warps; seq column chunks)
      [ "${PRODUCERS_SWEEP:-0}" = 1 ] && run $PY -c "import sys; from mxattn.producers import sweep_rmsnorm_tiles; sweep_rmsnorm_tiles(outdir=sys.argv[1])" "$OUT" ;;
    rmsnormrows)
      pytest_groups rmsnorm_tests "-m gpu" "rmsnorm and (not rowsets or packers)" "rmsnorm and rowsets and seq-" \
        "rmsnorm and rowsets and both-32x128x4" "rmsnorm and rowsets and both-32x512x16"
      run $PY -c "import sys; from mxattn.producers import bench_producers, rowset_tiles; bench_producers(rep_ms=50, outdir=sys.argv[1], linear_sizes=(), rms_variants={o: rowset_tiles(o) for o in ('seq', 'both')})" "$OUT" ;;
    rmsnormblocks)
      # session 17: the token-block seq / both kernel (perf-notes-producers.md): its tests on the GPU (the CPU-marked
      # ones too: there they run the compiled kernel), then bench_producers with every token-block tile beside the
      # row-set defaults, rmsnorm only, alone on the GPU (RMS_TIMINGS, default "graph eager": CUDA-graph replays,
      # then eager calls; one rmsnorm_quant results file each)
      pytest_groups rmsnormblocks_tests "" "token_blocks and gpu" "token_blocks and not gpu"
      for timing in ${RMS_TIMINGS:-graph eager}; do
        run $PY -c "import sys; from mxattn.producers import bench_producers, rmsnorm_kernel_variants; bench_producers(rep_ms=50, outdir=sys.argv[1], linear_sizes=(), rms_variants=rmsnorm_kernel_variants, timing=sys.argv[2])" "$OUT" "$timing"
      done ;;
    varlen)
      run $PY -c "
import json, sys
from mxattn.kernels.varlen import bench_varlen
from mxattn.bench.results import write_result
rows = [bench_varlen(causal=c) for c in (False, True)]
# equal lengths (16 x 2048): the jagged path's own cost without raggedness (perf-notes-varlen.md)
rows += [dict(bench_varlen(causal=c, lengths=[2048] * 16, with_sdpa=False), lengths='16 x 2048') for c in (False, True)]
print(json.dumps(rows, indent=1))
print(write_result('varlen_fwd', rows, sys.argv[1]))
" "$OUT" ;;
    varlensweep)
      # issue 8: rate_vs_dense over several length draws (seeds), both head dims, causal and not, and tile configs
      # for d64 (VARLEN_SEEDS, default 0 1 2 3): is a row under 0.95 the draw, the noise, or the tile?
      run $PY -c "
import json, sys
from mxattn.kernels.attn_fwd import FwdConfig
from mxattn.kernels.varlen import bench_varlen
from mxattn.bench.results import write_result
seeds = [int(s) for s in sys.argv[2].split()]
cases = [dict(head_dim=d, causal=c, seed=s) for d in (128, 64) for c in (False, True) for s in seeds]
cases += [dict(head_dim=64, causal=c, seed=0, config=cfg) for c in (False, True)
          for cfg in (FwdConfig(64, 64, 4, 3), FwdConfig(64, 128, 4, 3), FwdConfig(128, 64, 8, 3), FwdConfig(128, 128, 8, 2))]
rows = []
for kw in cases:
    try:
        r = bench_varlen(with_sdpa=False, **kw)
    except Exception as e:  # a tile the kernel refuses: say so, keep the other rows
        print('failed', kw, repr(e)[:200])
        continue
    rows.append(r)
    print(r['D'], r['causal'], r['seed'], r['config'], 'fill %.2f' % r['fill'], 'rate_vs_dense %.3f' % r['rate_vs_dense'], flush=True)
print(write_result('varlen_fwd', rows, sys.argv[1]))
" "$OUT" "${VARLEN_SEEDS:-0 1 2 3}" ;;
    fuseddq)
      # the fused-dQ backward (GluonDkdvConfig.fuse_dq, session 13, opt-in MXATTN_BWD_FUSED_DQ=1): compile check,
      # the tiny case under a short timeout (a barrier bug of the dS staging would hang), its other GPU tests, then
      # scripts/bench_fused_dq.py (kernels and the public backward vs the split kernels and cuDNN, one run)
      run $PY scripts/compile_check_bwd_dkdv_gluon.py --split --block-m 128 --fuse-dq 2>&1 | grep -E "^== |variants"
      T_SAVE=$T; T=150
      run $PY -m pytest -m gpu -q -x -rfE -p no:cacheprovider tests/test_attn_bwd_dkdv_gluon.py -k "fused_dq and tiny" \
        2>&1 | tail -5
      T=$T_SAVE
      run $PY -m pytest -m gpu -q -rfE -s -p no:cacheprovider tests/test_attn_bwd_dkdv_gluon.py \
        -k "${FUSED_DQ_K:-fused_dq and not tiny}" \
        2>&1 | grep -E "SQNR|passed|failed|Error|assert" | tail -30
      [ "${FUSED_DQ_BENCH:-1}" = 0 ] || run $PY scripts/bench_fused_dq.py "$OUT" ${FUSED_DQ_SHAPES:-} ;;
    qkvchain)
      # issue 7's chain: rmsnorm_quant -> qkv_proj (rotary) -> mxfp8_attn_func against the BF16 chain, forward time
      # and peak memory (mxattn.qkv.bench_qkv_chain; MHA 16/16 and GQA 16/4, B2 S4096 dim 2048): qkv_chain JSON
      run $PY -c "import sys, json; from mxattn.qkv import bench_qkv_chain; r = bench_qkv_chain(outdir=sys.argv[1]); print(json.dumps(r['rows'], indent=1))" "$OUT" ;;
    fwdprobe)
      # the Gluon forward's cost split (attn_fwd_gluon.FWD_PROBE, timing only): the probe builds compiled side by
      # side, then timed one after the other on FP8 operands (d128 S 8k both masks, S 4k, d64 S 8k); probe 0 also
      # times the tl kernel and SDPA cuDNN BF16.  Rows: OUTDIR/fwd_probe.jsonl, printed
      for p in 0 1 2 3 4; do
        MXATTN_FWD_PROBE=$p run $PY scripts/probe_fwd_gluon.py --compile-only "$OUT/fwd_probe_compile.jsonl" &
      done
      wait
      for p in 0 1 2 3 4; do MXATTN_FWD_PROBE=$p run $PY scripts/probe_fwd_gluon.py "$OUT/fwd_probe.jsonl"; done ;;
    bwdprobe)
      # the Gluon dK/dV step's cost split (attn_bwd_dkdv_gluon.DKDV_PROBE, timing only): builds compiled side by side,
      # then timed one after the other (d128 S 8k both masks, S 4k, the training shape B8 H12 S2k d64 causal); probe
      # 0 also times the dQ kernel.  Rows: OUTDIR/bwd_probe.jsonl, printed
      for p in 0 1 2; do
        MXATTN_DKDV_PROBE=$p run $PY scripts/probe_bwd_gluon.py --compile-only "$OUT/bwd_probe_compile.jsonl" &
      done
      wait
      for p in 0 1 2; do MXATTN_DKDV_PROBE=$p run $PY scripts/probe_bwd_gluon.py "$OUT/bwd_probe.jsonl"; done ;;
    fwdmask)
      # session 19: the Gluon forward's lean masked-tile arithmetic (GluonFwdConfig.mask="lean"): compile check, its GPU
      # tests (bit-identical to "select", per-block and persistent), then the bench (causal S 2k / 4k / 8k and
      # unaligned Sk, d128 / d64, 3 turns; FWDMASK_ARGS="--cuda-graph" for replays): OUTDIR/fwd_mask.json
      run $PY scripts/compile_check_gluon.py --only d128_causal_nopingpong,d64_causal_nopingpong --mask lean
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_attn_fwd_gluon.py -k "lean or fp32_out" 2>&1 \
        | tail -15 || status=1
      run $PY tests/test_attn_fwd_gluon.py --mask --repeats 3 ${FWDMASK_ARGS:-} --out "$OUT/fwd_mask.json" ;;
    bwdrows)
      # session 19: the Gluon backward kernels' row-wise epilogue stores (MXATTN_BWD_OUT_ROWS=1, read at import):
      # the launched builds of both settings (spills, STG widths), the GPU tests that compare the kernels with their
      # tl twins bit for bit run with it on (dQ whole, dK/dV's matches_tl / key_exp / configs cases, sharded), then
      # both settings timed in turns (0 1 0 1: drift shows) by scripts/probe_bwd_gluon.py: OUTDIR/bwd_rows.jsonl
      for v in 0 1; do for a in "--shape 2,4096,16,16,128" "--shape 2,4096,16,16,128 --causal"; do
        for c in dkdv dq; do echo "-- OUT_ROWS=$v $c $a"; MXATTN_BWD_OUT_ROWS=$v run $PY scripts/compile_launched.py $c $a \
          | grep -E "highest|spill|STG|loop . LDL"; done; done; done
      for i in 0 1 2; do
        MXATTN_BWD_OUT_ROWS=1 MXATTN_TEST_SHARD=$i/3 run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider -k "not bench" \
          tests/test_attn_bwd_dq_gluon.py > "$OUT/bwd_rows_tests.dq.$i.log" 2>&1 &
        MXATTN_BWD_OUT_ROWS=1 MXATTN_TEST_SHARD=$i/3 run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider \
          -k "matches_tl or key_exp_tiny or configs or unseen or q_perm or step_rows" tests/test_attn_bwd_dkdv_gluon.py \
          > "$OUT/bwd_rows_tests.dkdv.$i.log" 2>&1 &
      done
      wait
      cat "$OUT"/bwd_rows_tests.*.log > "$OUT/bwd_rows_tests.log"; rm -f "$OUT"/bwd_rows_tests.*.log
      grep -E "passed|failed|^FAILED|^ERROR" "$OUT/bwd_rows_tests.log" | tail -12
      grep -qE "^(FAILED|ERROR)" "$OUT/bwd_rows_tests.log" && status=1
      for v in 0 1 0 1; do MXATTN_BWD_OUT_ROWS=$v run $PY scripts/probe_bwd_gluon.py "$OUT/bwd_rows.jsonl"; done ;;
    bwdpersistent)
      # session 20: the persistent dK/dV kernel (GluonDkdvConfig.persistent, MXATTN_BWD_PERSISTENT=1; opt-in): its
      # build report, the bit-identity tests against the per-block kernel (the smallest case first under a short
      # timeout: a barrier bug shows as a hang), then the probe with the persistent row beside the per-block one, in
      # two turns: OUTDIR/bwd_persistent.jsonl
      for a in "" "--causal"; do MXATTN_BWD_PERSISTENT=1 run $PY scripts/compile_launched.py dkdv --shape 2,4096,16,16,128 $a \
        | grep -E "highest|spill|loop . LDL"; done
      T=120 run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_attn_bwd_dkdv_gluon.py \
        -k "persistent_bit_identical and 3x129" 2>&1 | tail -3
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_attn_bwd_dkdv_gluon.py -k "persistent" 2>&1 \
        | tail -8 || status=1
      for i in 1 2; do MXATTN_PROBE_PERSISTENT=1 run $PY scripts/probe_bwd_gluon.py "$OUT/bwd_persistent.jsonl"; done ;;
    bwdfold)
      # session 21: δ's launch writes the dense dK/dV kernel's step rows (one launch less a backward): the GPU tests
      # that reach it (δ's rows against _step_rows bit for bit, the Gluon backward against tl through attn_bwd_hopper
      # and loss.backward(), a plan hit against the checked path), then the host rows of the backward alone
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_attn_bwd.py tests/test_host_plans.py \
        -k "step_rows or gluon or plan" 2>&1 | tail -6 || status=1  # (test_gpu_delta_launch_* bit for bit)
      run $PY scripts/host_timing.py --calls 50 --only backward,fwd+bwd --out "$OUT" | tee "$OUT/host_timing.txt" ;;
    steprows)
      # session 22: the δ launch's step rows against _step_rows' kernel bit for bit (+0 past Sq since session 22)
      run $PY -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider tests/test_attn_bwd.py -k "step_rows" 2>&1 \
        | tail -15 || status=1 ;;
    eagergap)
      # session 22: eager against graph at S 2k: host time per call, a sleep probe for hidden synchronizations,
      # the allocator's device allocations (scripts/eager_gap.py): eager_gap JSON
      run $PY scripts/eager_gap.py "$OUT" ${EAGER_GAP_ARGS:-} ;;
    bwdbase)
      # session 20: the Gluon backward kernels of a base tree (BWD_BASE, default _s19base, made before the call with
      # `git archive 1bfaccb mxattn | tar -x -C _s19base`; skipped when absent) and of this tree, timed in turns
      # (base, this, base, this) by scripts/probe_bwd_gluon.py: OUTDIR/bwd_base.jsonl (rows carry "tree")
      for i in 1 2; do for tree in "${BWD_BASE:-_s19base}" .; do
        [ -d "$tree/mxattn" ] || { echo "bwdbase: no $tree/mxattn"; continue; }
        PYTHONPATH=$tree run $PY scripts/probe_bwd_gluon.py "$OUT/bwd_base.jsonl"; done; done ;;
    dqprobe)
      # the fused dQ's cost split (attn_bwd_dkdv_gluon.DQ_PROBE, timing only): the probe builds compiled side by side
      # on tiny shapes, then timed one after the other at B2 H16 S8k d64 (both masks) and B8 H12 S2k d64 causal;
      # probe 0 also times the split kernels and dK/dV alone.  Rows: OUTDIR/dq_probe.jsonl, printed
      for p in 0 1 3 4; do
        MXATTN_DQ_PROBE=$p run $PY scripts/probe_fused_dq.py --compile-only "$OUT/dq_probe_compile.jsonl" &
      done
      wait
      for p in 0 1 3 4; do MXATTN_DQ_PROBE=$p run $PY scripts/probe_fused_dq.py "$OUT/dq_probe.jsonl"; done ;;
    dqslots)
      # session 23: the dQ step's barriers (GluonDqConfig.amax_slots; docs/perf-notes-attn-bwd.md): the
      # bit-identity tests (the smallest case first under a short timeout: a barrier bug hangs rather than fails),
      # then base / slots in turns (bench_dq_variants.py, each row checks its outputs bit for bit against base too)
      # (the split builds only by default, the API's: DQSLOTS_K widens it; each mode is its own build per case)
      T=120 run $PY -m pytest -m gpu -q -x -rfE -p no:cacheprovider tests/test_attn_bwd_dq_gluon.py \
        -k "amax_slots and 129 and split" 2>&1 | tail -3
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_attn_bwd_dq_gluon.py \
        -k "${DQSLOTS_K:-amax_slots and split}" 2>&1 | tail -5
      run $PY scripts/bench_dq_variants.py "$OUT" ${DQSLOTS_ARGS:---variants slots} ;;
    lpt)
      # session 24: causal CTA order over sections of heads (MXATTN_CAUSAL_LPT, the configs' causal_lpt): the
      # bit-identity tests, then each kernel and the public backward with the variable 0 / 1 in turns
      # (bench_env_turns.py, one process each; LPT_KERNELS narrows, LPT_ARGS adds options).  fwd-gluon's 0 / 1 is
      # the persistent kernel against the per-block kernel with the order (default_config's causal rule)
      # (not -m gpu: the tl order's tests run on the CPU's interpreter and on the GPU alike, unmarked)
      run $PY -m pytest -q -rfE -p no:cacheprovider tests/test_attn_bwd_dq_gluon.py \
        tests/test_attn_bwd_dkdv_gluon.py tests/test_attn_fwd.py tests/test_cta_order.py \
        -k "causal_lpt or cta_order" 2>&1 | tail -5 || status=1
      # the Gluon forward's per-block kernel with causal_lpt against the other builds, bit for bit
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_attn_fwd_gluon.py \
        -k "variant_bit_identical and True and causal_lpt" 2>&1 | tail -3 || status=1
      for kern in ${LPT_KERNELS:-dkdv dq fwd-gluon bwd}; do
        mkdir -p "$OUT/lpt-$kern"
        run $PY scripts/bench_env_turns.py "$OUT/lpt-$kern" --var MXATTN_CAUSAL_LPT --kernel "$kern" ${LPT_ARGS:-}
      done ;;
    lptfwd)
      # session 24: the forwards' causal CTA order.  Bit-identity tests (tl kernel; the per-block Gluon kernel), then
      # the Gluon forward persistent (the default) against per-block with causal_lpt, and the tl forward with
      # MXATTN_CAUSAL_LPT 0 / 1, in turns (bench_env_turns.py; LPT_ARGS adds options)
      run $PY -m pytest -q -rfE -p no:cacheprovider tests/test_attn_fwd.py tests/test_attn_fwd_gluon.py \
        tests/test_cta_order.py -k "causal_lpt or cta_order" 2>&1 | tail -4 || status=1
      mkdir -p "$OUT/lpt-fwd-gluon-perblock" "$OUT/lpt-fwd-tl"
      # (MXATTN_CAUSAL_LPT=0 also keeps causal launches on the persistent kernel: default_config's rule)
      run $PY scripts/bench_env_turns.py "$OUT/lpt-fwd-gluon-perblock" --kernel fwd-gluon --values \
        MXATTN_FWD_PERSISTENT=1,MXATTN_CAUSAL_LPT=0 MXATTN_FWD_PERSISTENT=0,MXATTN_CAUSAL_LPT=1 \
        MXATTN_FWD_PERSISTENT=0,MXATTN_CAUSAL_LPT=0 ${LPT_ARGS:-}
      run $PY scripts/bench_env_turns.py "$OUT/lpt-fwd-tl" --kernel fwd-tl --var MXATTN_CAUSAL_LPT --values 0 1 \
        ${LPT_ARGS:-} ;;
    fuseddqbench)  # the fuseddq stage's bench alone (its tests elsewhere in the call)
      run $PY scripts/bench_fused_dq.py "$OUT" ${FUSED_DQ_SHAPES:-} ;;
    varlenbwd|varlenbwdtime)
      # issue 8: the jagged backward against the dense default (the Gluon backward on Hopper since session 5).
      # The Gluon kernels' jagged mode (VARLEN; the default on Hopper since session 12): compile checks, two tiny
      # cases under a short timeout (a barrier bug hangs rather than fails), its GPU tests,
      # then the timings with MXATTN_VARLEN_BWD_KERNEL=gluon unless set (each row: the asked path and the tl
      # jagged path, both against the dense Gluon backward). varlenbwdtime: the timings alone
      if [ "$st" = varlenbwd ]; then
        run $PY scripts/compile_check_bwd_dq_gluon.py --varlen --split
        run $PY scripts/compile_check_bwd_dkdv_gluon.py --varlen --split
        T=120 run $PY -m pytest -m gpu -q -x -rfE -p no:cacheprovider tests/test_bwd_varlen_gluon.py \
          -k "matches_tl and (1seq-h1 or 2seq-h2)"
        run $PY -m pytest -m gpu -q -rfE -s -p no:cacheprovider tests/test_bwd_varlen_gluon.py \
          2>&1 | tee "$OUT/bwd_varlen_gluon_tests.log" | tail -40
      fi
      MXATTN_VARLEN_BWD_KERNEL=${MXATTN_VARLEN_BWD_KERNEL:-gluon} run $PY -c "
import json, sys
from mxattn.kernels.varlen import bench_varlen_bwd
from mxattn.bench.results import write_result
fmt = lambda d: ' '.join(k + ' ' + ('-' if v is None else '%.3f' % v) for k, v in d.items())
rows = []
for c in (False, True):
    for s in map(int, sys.argv[2].split()):
        r = bench_varlen_bwd(causal=c, seed=s)
        rows.append(r)
        print(r['causal'], r['seed'] if 'seed' in r else s, r['varlen_kernel'], 'rate_vs_dense %.3f' % r['rate_vs_dense'],
              'tl %.3f' % r['rate_vs_dense_tl'], 'vs sdpa cudnn padded', r['speedup_vs_sdpa_cudnn_padded'], flush=True)
        print('  ms', fmt(r['ms']), '| parts', fmt(r['parts_ms']), '| host', fmt(r['host_ms']), flush=True)
print(write_result('varlen_bwd', rows, sys.argv[1]))
" "$OUT" "${VARLEN_BWD_SEEDS:-0 1}" ;;
    graph)
      # forward and backward as CUDA-graph replays; first the test that replays equal the eager gradients
      run $PY -m pytest -m gpu -q -rfE -p no:cacheprovider tests/test_cli.py -k graphed_backward 2>&1 | tail -3 \
        || status=1
      run $PY -m mxattn bench --cuda-graph --out "$OUT" --no-plot --no-progress ${GRAPH_ARGS:---seqlens 2k,4k --head-dims 128,64} ;;
    ring)
      # every GPU of the machine (RING_NPROC to override), one rank each (NVLink multicast off); the check against
      # single-GPU mxattn first. RING_NPROC=1 on one GPU measures the per-block cost of the ring (no wire).
      NGPU=${RING_NPROC:-$(nvidia-smi -L | wc -l)}
      # the check's local chunks are below the Gluon forward's S >= 8k: check once more with it forced (the timed
      # 64k-256k runs take it)
      NCCL_NVLS_ENABLE=0 MXATTN_FWD_KERNEL=gluon run $PY -m torch.distributed.run --standalone \
        --nproc-per-node "$NGPU" -m mxattn.distributed --check-only
      NCCL_NVLS_ENABLE=0 run $PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m mxattn.distributed \
        --check --causal --outdir "$OUT" ${RING_ARGS:---seqlen 65536 131072 262144 --profile} ;;
    train)
      # issue 9's parity run; one half per call fits the 10-minute limit: TRAIN_ATTENTION=sdpa, then mxfp8, then
      # compare the two loss-*.json locally with `--attention both --reuse` (docs/training-parity.md)
      run $PY examples/train_gpt.py --attention "${TRAIN_ATTENTION:-both}" --out "$OUT/train" --no-progress ${TRAIN_ARGS:-} ;;
    trainpar)
      # one process per GPU, same data and init; the step times come from two like GPUs of one host
      mkdir -p "$OUT/train"
      for a in sdpa mxfp8; do
        gpu=$([ $a = sdpa ] && echo 0 || echo 1)
        CUDA_VISIBLE_DEVICES=$gpu timeout "$T" $PY examples/train_gpt.py --attention $a --out "$OUT/train" --no-progress \
          ${TRAIN_ARGS:-} > "$OUT/train/log-$a.txt" 2>&1 &
      done
      wait
      tail -n 4 "$OUT"/train/log-*.txt
      [ -f "$OUT/train/loss-sdpa.json" ] && [ -f "$OUT/train/loss-mxfp8.json" ] || { echo "!! a half did not finish"; status=1; continue; }
      run $PY examples/train_gpt.py --attention both --reuse --out "$OUT/train" --no-progress ${TRAIN_ARGS:-} ;;
    blockscaled)
      run $PY -c "
import sys
sys.path.insert(0, 'tests')
from test_attn_blockscaled import bench_blockscaled
from mxattn.bench.results import write_result
from test_attn_blockscaled import bench_blockscaled_train
rows = [dict(B=2, H=16, S=4096, D=128, causal=c, direction='fwd', tflops=bench_blockscaled(causal=c)) for c in (False, True)]
rows += [dict(B=2, H=16, S=4096, D=128, causal=c, direction='fwd+bwd', tflops=bench_blockscaled_train(causal=c))
         for c in (False, True)]
for r in rows: print(r)
print(write_result('blockscaled', rows, sys.argv[1], extra={'note': 'tl.dot_scaled upcast to bf16 wgmma on sm_90'}))
" "$OUT" ;;
    ncu)
      # where the Gluon forward, dK/dV and dQ kernels spend their time: speed of light, warp stalls, issue slots, the
      # SASS lines that stall most. One fwd+bwd to compile, then the second one's three kernels are profiled.
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
      read -r nb nh ns nd nc <<< "${NCU_SHAPE:-2 16 8192 128 1}"
      run "$NCU" --clock-control none --kernel-name regex:"_attn_(fwd|bwd_dkdv|bwd_dq)_ws_kernel" --launch-skip 3 --launch-count 3 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
        --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section SourceCounters \
        $PY -c "
import sys, torch
from mxattn import mxfp8_attn_func
B, H, S, D, c = (int(x) for x in sys.argv[1:6])
q, k, v, do = (torch.randn(B, S, H, D, device='cuda', dtype=torch.bfloat16) for _ in range(4))
for _ in range(2):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    mxfp8_attn_func(*leaves, causal=bool(c)).backward(do)
torch.cuda.synchronize()
" $nb $nh $ns $nd $nc > "$OUT/ncu_bwd.txt" 2>&1
      grep -E "^  [a-zA-Z_]+.*\(|Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" "$OUT/ncu_bwd.txt" | head -40 ;;
    sanitize)
      MXATTN_SANITIZE_JOBS=${MXATTN_SANITIZE_JOBS:-6} run bash scripts/sanitize.sh "$OUT/sanitize" ${SANITIZE_CASES:-fwd bwd varlen} ;;
    *) echo "unknown stage $st"; status=1 ;;
  esac
done
exit $status
