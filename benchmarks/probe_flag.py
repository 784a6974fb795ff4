"""One-off probe (2026-11-30): cuBLAS time of two shapes with torch's default cuBLAS settings,
then after `allow_bf16_reduced_precision_reduction = True` is set explicitly."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibrate_gemm import measure_cuda  # noqa: E402

shapes = [(2048, 3584, 4096), (1024, 7168, 4096), (4096, 4096, 4096)]
print("default:", torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
before = {s: sorted(measure_cuda(*s, torch.bfloat16) for _ in range(3))[1] for s in shapes}
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
after = {s: sorted(measure_cuda(*s, torch.bfloat16) for _ in range(3))[1] for s in shapes}
for s in shapes:
    print(f"{s}: default {before[s] * 1e3:.1f} us, after setting True {after[s] * 1e3:.1f} us")
