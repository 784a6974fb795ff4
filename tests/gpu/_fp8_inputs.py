"""fp8 operands the GPU tests of the GEMM core share (test_gemm_core.py, test_gemm_pp_gpu.py)."""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn


def fp8_operands(m, n, k, mode, a_dtype=E4M3, b_dtype=E4M3, seed=0):
    """``(a [m, k], b = weight[n, k].t(), scale_a, scale_b)`` from one seeded generator on CUDA:
    fp8 values of N(0, 4) samples, and scales tensor-wise (``mode == "tensor"``: 0.75, 1.5) or
    row-/column-wise (``[m, 1]``, ``[1, n]`` in [0.25, 1.25))."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, generator=g, device="cuda") * 2).to(a_dtype)
    b = (torch.randn(n, k, generator=g, device="cuda") * 2).to(b_dtype).t()
    if mode == "tensor":
        sa, sb = torch.tensor(0.75, device="cuda"), torch.tensor(1.5, device="cuda")
    else:
        sa = torch.rand(m, 1, generator=g, device="cuda") + 0.25
        sb = torch.rand(1, n, generator=g, device="cuda") + 0.25
    return a, b, sa, sb
