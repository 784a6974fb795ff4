#!/usr/bin/env bash
# Everything that needs the GPU, in one go (one device-tool call): the GPU tests (with 2+ GPUs
# also the NCCL multi-GPU ones), a demo on every visible GPU, the GEMM-core benchmark, and
# (CALIBRATE=1) the GEMM calibration; prints a short table last.
# Usage (repo root, on the GPU machine):  OUT=/some/dir bash scripts/gpu_check.sh [quick]
#   quick: tests, bed and demo only.  SKIP_DEMO=1: no demo.  SKIP_BED=1: no symmetric-memory bed
#     (BED_WORLD_SIZES default "2 4", BED_ARGS e.g. --quick, BED_LIMIT_S default 600).  *_LIMIT_S: wall-clock caps of the steps.
#     TESTS: pytest paths (default tests/gpu).   BENCH_LIMIT_S (default 420): wall-clock cap of the benchmark;
#     BENCH_ROUNDS (default 9): its interleaved timing rounds (5 left a couple of points of
#     spread in the per-shape hook overheads, git history of BENCHMARKS.md);
#     CALIB_LIMIT_S (default 300): of the calibration;
#   it writes its JSON after every shape, so a capped run keeps the shapes it finished.
#   PACK=1: at the end, pack everything under $OUT into $OUT/gpu_check.tgz and leave only that
#     (for a runner that brings back only a few files).
#   STEPS: the steps to run (default all: gpu_tests symm_bed bench_bed host_bed2 host_bed4 layer_bed_t4096
#     layer_bed_t512 demo demo_large bench host_overhead gemm_bench calibrate). All of them take ~25 min on one H200, more than one
#     device call (10 min): split them, e.g. STEPS="gpu_tests symm_bed" then STEPS=gemm_bench.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
PY=${PY:-python3}
summary=()
STEPS=${STEPS:-gpu_tests symm_bed bench_bed host_bed2 host_bed4 layer_bed_t4096 layer_bed_t512 demo demo_large bench host_overhead gemm_bench calibrate}
step() {  # step NAME CMD...: run, log to $OUT/NAME.log, remember pass/fail and seconds
  local name=$1; shift
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-100)")")
  return 0
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  date -u +%Y-%m-%dT%H:%M:%SZ
} > "$OUT/gpu.txt" 2>&1
GPUS=$($PY -c 'import torch; print(torch.cuda.device_count())')
step gpu_tests timeout "${TESTS_LIMIT_S:-400}" $PY -m pytest -q -p no:cacheprovider ${TESTS:-tests/gpu} --timeout 300 -rfEs --durations=15
# the one-GPU multi-process bed for the symmetric-memory strategies (MPS; tests/gpu/bed.py)
if [ "${SKIP_BED:-0}" != 1 ]; then
  nvidia-cuda-mps-control -d >/dev/null 2>&1; mps_started=$?
  step symm_bed timeout "${BED_LIMIT_S:-600}" $PY tests/gpu/bed.py --world-sizes ${BED_WORLD_SIZES:-2 4} ${BED_ARGS:-} --out "$OUT/symm_1gpu.json"
  if [ "${1:-}" != "quick" ]; then   # bed-only numbers (not multi-GPU timings): the bench in the bed
    step bench_bed timeout "${BENCH_BED_LIMIT_S:-240}" $PY -m tpfuse bench --bed 2 --quick --json "$OUT/bench_bed2.json" \
      --png "$OUT/bench_bed2.png" --timeline "$OUT/bench_bed2_timeline.png"
  fi
  # issue 34: host time of eager calls with the GPU busy ahead, next to async-TP (W = 2 and 4), and
  # the TP MLP block eager vs its CUDA-graph replay at T = 4096 and 512
  for w in ${HOST_BED_WORLD_SIZES:-2 4}; do
    step host_bed$w timeout "${HOST_BED_LIMIT_S:-240}" $PY -m tpfuse.bench.host --bed "$w" --m 2048 --n 1536 --k 2048 \
      --calls 50 --rounds 5 --json "$OUT/host_overhead_h200_bed$w.json"
  done
  for t in ${LAYER_BED_TOKENS:-4096 512}; do
    step layer_bed_t$t timeout "${LAYER_BED_LIMIT_S:-300}" $PY -m tpfuse bench layer --bed 2 --tokens "$t" \
      --strategies copy_engine fused --no-asynctp --json "$OUT/layer_bed2_t$t.json"
  done
  [ "$mps_started" = 0 ] && echo quit | nvidia-cuda-mps-control
fi
if [ "${SKIP_DEMO:-0}" != 1 ]; then
  step demo $PY -m tpfuse demo
  if [ "$GPUS" -ge 2 ]; then
    # real transfers between GPUs: larger cells, more repeats (still a demo, not the benchmark)
    step demo_large $PY -m tpfuse demo --scale 2 --repeats 20
  fi
fi
if [ "${1:-}" != "quick" ]; then
  if [ "$GPUS" -ge 2 ]; then  # every strategy on the workload matrix at W = GPUs
    step bench timeout "${STRAT_LIMIT_S:-200}" $PY -m tpfuse bench --world-size "$GPUS" --out "$OUT"
  fi
  step host_overhead timeout "${HOST_LIMIT_S:-120}" $PY -m tpfuse.bench.host --device cuda --json "$OUT/host_overhead.json"
  step gemm_bench timeout "${BENCH_LIMIT_S:-420}" $PY benchmarks/gemm_core.py --out "$OUT" --tune-rep 10 --rep 20 --rounds "${BENCH_ROUNDS:-9}"
  if [ "${CALIBRATE:-0}" = 1 ]; then
    step calibrate timeout "${CALIB_LIMIT_S:-300}" $PY benchmarks/calibrate_gemm.py --out "$OUT"
  fi
fi
cat "$OUT/gpu.txt"
printf '%s\n' "${summary[@]}"
if [ "${PACK:-0}" = 1 ]; then
  packed=$(mktemp "${TMPDIR:-/tmp}/gpu_check.XXXXXX") && tar czf "$packed" -C "$OUT" . \
    && find "$OUT" -mindepth 1 -delete && mv "$packed" "$OUT/gpu_check.tgz" && echo "packed into $OUT/gpu_check.tgz"
fi
