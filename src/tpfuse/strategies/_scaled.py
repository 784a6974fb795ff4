"""The GEMM of one chunk, scaled (fp8) or not: what every strategy's per-chunk compute calls.

``mm(a, b, scale_a_rows, scale_b, out_dtype)`` is ``a @ b`` for non-fp8 operands (``torch.matmul``,
the scales and ``out_dtype`` are None) and ``(a * scale_a) @ (b * scale_b)`` rounded to
``out_dtype`` for fp8 ones (``torch._scaled_mm``: fp32 accumulation on CPU and in cuBLASLt).

``scale_a_rows`` is the scale of exactly the rows of ``a`` passed (a strategy slicing row chunks
slices a row-wise scale alike; a tensor-wise scale passes unchanged).  Inputs were validated by
:mod:`tpfuse.ops` (:func:`tpfuse._fp8.check_scaled`).

On CUDA an fp8 ``a`` whose row count is not a multiple of :data:`ROW_MULTIPLE` is padded with
zero rows (scale 1) before ``torch._scaled_mm`` and the product's first rows are kept: on the
H200 bed (torch 2.11, CUDA 13) cuBLASLt refused a 37-row chunk of copy_engine's fp8 ag_gemm with
``CUBLAS_STATUS_NOT_SUPPORTED`` while every row count that is a multiple of 16 ran (the GEMM
benchmark's).  Rows are independent, so the kept rows are the unpadded product's.
"""

from __future__ import annotations

import torch

from tpfuse._fp8 import is_fp8

__all__ = ["mm", "wire", "ROW_MULTIPLE"]

ROW_MULTIPLE = 16   # the fp8 row counts cuBLASLt took on the H200 (module docstring)


def _pad_rows(device: torch.device) -> bool:
    """Whether fp8 operands on ``device`` get their rows padded to ``ROW_MULTIPLE`` (CUDA)."""
    return device.type == "cuda"


def mm(a: torch.Tensor, b: torch.Tensor, scale_a_rows: torch.Tensor | None = None,
       scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
       out: torch.Tensor | None = None) -> torch.Tensor:
    """``a`` [m, k] @ ``b`` [k, n], scaled for fp8; written into ``out`` when given."""
    if not is_fp8(a.dtype):
        return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
    scale_a, scale_b = scale_a_rows, scale_b
    # torch._scaled_mm takes either two tensor-wise scales or two row-wise ones ([m, 1] and
    # [1, n]); a mix is expanded to row-wise (a few floats).
    if (scale_a.dim() == 2) != (scale_b.dim() == 2):
        if scale_a.dim() == 2:
            scale_b = scale_b.reshape(1, 1).expand(1, b.shape[1]).contiguous()
        else:
            scale_a = scale_a.reshape(1, 1).expand(a.shape[0], 1).contiguous()
    if a.device.type == "cuda":
        # cuBLASLt multiplies a row-major a by a column-major b; weight.t() of a contiguous
        # [N, K] weight already is column-major, so the usual call copies nothing.
        if a.stride(1) != 1 or a.stride(0) < max(1, a.shape[1]):
            a = a.contiguous()
        if b.stride(0) != 1 or b.stride(1) < max(1, b.shape[0]):
            b = b.t().contiguous().t()
    m = a.shape[0]
    if m % ROW_MULTIPLE and _pad_rows(a.device):
        padded = -(-m // ROW_MULTIPLE) * ROW_MULTIPLE
        a_pad = a.new_zeros((padded, a.shape[1]), dtype=torch.uint8)   # zero bytes: +0.0 in e4m3 and e5m2
        a_pad[:m].copy_(a.view(torch.uint8))
        a_pad = a_pad.view(a.dtype)
        if scale_a.dim() == 2:
            s_pad = scale_a.new_ones((padded, 1))
            s_pad[:m] = scale_a
            scale_a = s_pad
        rows = torch._scaled_mm(a_pad, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)[:m]
        return rows if out is None else out.copy_(rows)
    kwargs = {} if out is None else {"out": out}
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **kwargs)


def wire(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the collectives carry it: fp8 bytes viewed as uint8 (gloo has no fp8 type; the
    bytes, hence the values, are unchanged), anything else as it is."""
    return x.view(torch.uint8) if is_fp8(x.dtype) else x
