#!/usr/bin/env bash
# Everything that needs the GPU, in one go (one device-tool call):
#   GPU tests, the GEMM-core benchmark, the GEMM calibration, and a demo; prints a short table last.
# Usage (repo root, on the GPU machine):  OUT=/some/dir bash scripts/gpu_check.sh [quick]
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
PY=${PY:-python3}
summary=()
step() {  # step NAME CMD...: run, log to $OUT/NAME.log, remember pass/fail and seconds
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-90)")")
  return 0
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" >> "$OUT/gpu.txt" 2>&1
step gpu_tests $PY -m pytest -q -p no:cacheprovider tests/gpu -x --timeout 600
if [ "${1:-}" != "quick" ]; then
  step gemm_bench $PY benchmarks/gemm_core.py --out "$OUT"
  step calibrate $PY benchmarks/calibrate_gemm.py --out "$OUT"
fi
step demo $PY -m tpfuse demo --world-size 1
cat "$OUT/gpu.txt"
printf '%s\n' "${summary[@]}"
