"""fp8 (float8) facts and helpers of the scaled ops and layers.

Section 1 holds the fp8 checks the scaled ops share: which mixes of the policy's fp8 dtypes
(``tpfuse.dtypes.FP8``) run, what the scales look like, which output dtypes are allowed, and the
K/N size rule.  Which strategies take fp8 is each strategy's ``DTYPES`` entry (the registry).

Section 2 is the dynamic scaling the fp8 layers use (amax -> scale -> cast), after torchao's
float8 training recipes (``torchao/float8/float8_utils.py``, ``config.py``).

Scale convention: the ops take *dequantization* scales, as ``torch._scaled_mm`` does: the value
an fp8 element stands for is ``element * scale``.  (torchao stores the reciprocal, the
quantization multiplier, and passes ``scale.reciprocal()`` to ``torch._scaled_mm``.)
"""

from __future__ import annotations

import torch

from tpfuse import dtypes

__all__ = ["FP8_DTYPES", "E4M3", "E5M2", "LEGAL_PAIRS", "OUT_DTYPES", "DEFAULT_OUT_DTYPE", "SCALE_DTYPE",
           "ALIGN", "is_fp8", "check_scaled", "scale_kind",
           "RECIPES", "quantize"]

# ============================================================================================
# 1. The scaled ops' checks (the fp8 dtypes themselves: tpfuse.dtypes.FP8)
# ============================================================================================

FP8_DTYPES = dtypes.FP8.inputs            # the policy's fp8 rule (tpfuse/dtypes.py)
E4M3, E5M2 = FP8_DTYPES

# (dtype of a, dtype of b): e4m3 x e4m3 everywhere; a gradient in e5m2 times an e4m3 operand.
# e5m2 x e5m2 is refused: cuBLASLt (torch._scaled_mm on CUDA) has no such kernel, and the CPU
# accepting it would make a program that passes on CPU fail on the GPU.
LEGAL_PAIRS = frozenset({(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)})

# Output dtypes of a scaled GEMM; fp8 outputs are refused (they need an output scale and amax
# handling the ops do not have).
OUT_DTYPES = dtypes.FP8.out_dtypes
DEFAULT_OUT_DTYPE = OUT_DTYPES[0]    # bfloat16, as torch's scaled async-TP ops
SCALE_DTYPE = torch.float32

# K and N of an fp8 GEMM must be multiples of ALIGN: cuBLASLt's fp8 GEMMs need 16-byte aligned
# leading dimensions of both operands (torch._scaled_mm on CUDA refuses other sizes: "mat2 shape
# must be divisible by 16") and the fp8 wgmma of the Triton core reads K in 32-byte steps.  The CPU
# kernel would take any size; tpfuse enforces the rule on every device so that a program checked
# on CPU ranks runs on GPUs.  M (rows) is free.
ALIGN = 16

def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def scale_kind(scale: torch.Tensor) -> str:
    """'tensor-wise' or 'row-wise' for a scale that passed :func:`check_scaled`."""
    return "tensor-wise" if scale.numel() == 1 and scale.dim() < 2 else "row-wise"


def _check_scale(op: str, name: str, scale: object, rowwise_shape: tuple[int, int], rowwise_words: str,
                 device: torch.device) -> str:
    if scale is None:
        raise ValueError(f"{op}: {name} is required for fp8 inputs; pass a float32 tensor: 0-d "
                         f"(tensor-wise) or {list(rowwise_shape)} ({rowwise_words})")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor (float32), got {type(scale).__name__}")
    if scale.dtype != SCALE_DTYPE:
        raise TypeError(f"{op}: {name} must be float32, got {scale.dtype}; pass {name}.float()")
    if scale.device != device:
        raise ValueError(f"{op}: {name} is on {scale.device} but the operands are on {device}; move it there")
    if scale.dim() <= 1 and scale.numel() == 1:
        return "tensor-wise"
    if tuple(scale.shape) == rowwise_shape:
        return "row-wise"
    raise ValueError(f"{op}: {name} has shape {tuple(scale.shape)}; use a 0-d (or 1-element) tensor for "
                     f"tensor-wise scaling or shape {list(rowwise_shape)} ({rowwise_words})")


def check_scaled(op: str, a_name: str, a: torch.Tensor, b: torch.Tensor, scale_a: object, scale_b: object,
                 out_dtype: object) -> None:
    """Raise ``TypeError``/``ValueError`` for scales, ``out_dtype`` or fp8 operands that no scaled
    GEMM takes (``a``, ``b`` passed the matrix checks)."""
    fp8_a, fp8_b = is_fp8(a.dtype), is_fp8(b.dtype)
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"{op}: out_dtype must be a torch.dtype, got {type(out_dtype).__name__} {out_dtype!r}")
    if not (fp8_a or fp8_b):
        for name, value in (("scale_a", scale_a), ("scale_b", scale_b), ("out_dtype", out_dtype)):
            if value is not None:
                raise ValueError(f"{op}: {name} is for fp8 inputs (float8_e4m3fn/float8_e5m2), but {a_name} and b "
                                 f"are {a.dtype}; drop {name} (cast the result with .to() for another dtype)")
        return
    if fp8_a != fp8_b:
        fp8_name, other, other_dtype = (a_name, "b", b.dtype) if fp8_a else ("b", a_name, a.dtype)
        raise TypeError(f"{op}: {fp8_name} is fp8 ({(a if fp8_a else b).dtype}) but {other} is {other_dtype}; "
                        f"quantize {other} to torch.float8_e4m3fn with a scale too (tpfuse._fp8.quantize)")
    if (a.dtype, b.dtype) not in LEGAL_PAIRS:
        raise TypeError(f"{op}: {a_name} and b are both float8_e5m2, which no fp8 GEMM multiplies; use "
                        "float8_e4m3fn for one of them (e5m2 is for gradients, times an e4m3 operand)")
    if out_dtype is not None and out_dtype not in OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype {out_dtype} is not supported for fp8 inputs; use one of "
                        f"{', '.join(map(str, OUT_DTYPES))} (default {DEFAULT_OUT_DTYPE})")
    k, n = a.shape[1], b.shape[1]
    if k % ALIGN or n % ALIGN:
        raise ValueError(f"{op}: fp8 needs K and N multiples of {ALIGN} (the fp8 tensor cores' alignment, "
                         f"enforced on every device), got K = {k}, N = {n}; pad them to "
                         f"{-(-k // ALIGN) * ALIGN} and {-(-n // ALIGN) * ALIGN}")
    rows = "one per row of a_shard" if op == "ag_gemm" else f"one per row of {a_name}"
    _check_scale(op, "scale_a", scale_a, (a.shape[0], 1), rows, a.device)
    _check_scale(op, "scale_b", scale_b, (1, n), "one per column of b", a.device)


# ============================================================================================
# 2. Dynamic scaling for the fp8 layers (torchao's float8 training recipes)
# ============================================================================================

# recipe -> how each GEMM's operands are cast (granularity, fp8 dtype), as in torchao's
# Float8LinearConfig.from_recipe_name.  "rows" = one scale per row of the GEMM's left operand /
# column of its right operand; "tensor" = one scale.  Weight gradient: high precision in both.
RECIPES = {
    # torchao "tensorwise": e4m3 input and weight, e5m2 output gradient, all tensor-wise.
    # Departure: torchao's tensorwise recipe also runs the weight-gradient GEMM in fp8; here it
    # runs in the parameters' dtype (the wgrad GEMM has no collective to fuse with).
    "tensorwise": {"forward": (("tensor", E4M3), ("tensor", E4M3)),
                   "grad_input": (("tensor", E5M2), ("tensor", E4M3))},
    # torchao "rowwise_with_gw_hp": input rows and weight output channels row-wise e4m3; output
    # gradient rows e4m3 times a tensor-wise e4m3 weight; weight gradient in high precision.
    "rowwise": {"forward": (("rows", E4M3), ("rows", E4M3)),
                "grad_input": (("rows", E4M3), ("tensor", E4M3))},
}

_EPS = 1e-12  # torchao's EPS: amax floor so that an all-zero tensor gets a finite scale


def quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str, *, dim: int = -1,
             amax: torch.Tensor | None = None, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to fp8 ``dtype`` with a dynamic scale: returns (x_fp8, dequantization scale).

    ``granularity`` "tensor": one float32 scale (0-d); "rows": one per slice along ``dim`` kept
    (``dim=-1``: per row, scale [rows, 1]; ``dim=0``: per column, scale [1, cols]).  The scale is
    ``amax / fp8_max`` (torchao's ``amax_to_scale``, inverted), computed in float64 then rounded to
    float32; ``pow2`` rounds the quantization multiplier down to a power of two (torchao does for
    its row-wise recipes: the cast is then exact in the exponent).  ``amax`` overrides the
    tensor-wise amax (the layers pass one reduced over the group).
    """
    if amax is None:
        amax = x.abs().amax() if granularity == "tensor" else x.abs().amax(dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    multiplier = (fmax / amax.double().clamp(min=_EPS)).float()
    if pow2:
        multiplier = torch.exp2(torch.floor(torch.log2(multiplier)))
    x_fp8 = (x.float() * multiplier).clamp(-fmax, fmax).to(dtype)
    return x_fp8, multiplier.reciprocal()
