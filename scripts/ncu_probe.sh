#!/usr/bin/env bash
# Profile a few GEMM kernels with Nsight Compute (clocks left alone) and time them by graph
# replay; results under $OUT. Usage: OUT=dir bash scripts/ncu_probe.sh "M,N,K" SPEC...
# (SPEC as in benchmarks/profile_kernels.py; "cublas" = torch.matmul).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/.out}; mkdir -p "$OUT"
shape=$1; shift
tag=${shape//,/x}
python3 benchmarks/profile_kernels.py --shape "$shape" --configs "$@" --repeat ${REPEAT:-7} ${HOT:+--hot} | tee "$OUT/time_$tag.txt"
if [ "${NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
  timeout ${NCU_LIMIT_S:-240} ncu --clock-control none --kernel-name regex:'gemm_kernel|sm90|nvjet|cutlass|gemm' \
    --launch-skip ${NCU_SKIP:-0} \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis \
    python3 benchmarks/profile_kernels.py --shape "$shape" --configs "$@" > "$OUT/ncu_$tag.txt" 2>&1
  echo "ncu rc=$?"
  grep -E '^  [a-zA-Z_0-9]+.*\(|Duration|Registers Per|Dynamic Shared|Memory Throughput|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Warp Cycles Per Issued|Achieved Occupancy|Local' "$OUT/ncu_$tag.txt" | head -${NCU_LINES:-120}
fi
