"""The GEMM core's dtype facts, Triton-free: which torch dtypes the kernels take, their Triton
type names, element sizes, the K multiple the tensor cores need, which outputs an input
dtype may be rounded to, and the scale modes of fp8 inputs. The host side (``tpfuse/gemm``)
asks these tables instead of naming dtypes; the kernels get a Triton type by name
(``getattr(triton.language, tl_name(dtype))``).
"""
import torch

# Input dtype -> the Triton type name of its tiles.
_TL_NAMES = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8e4nv",
    torch.float8_e5m2: "float8e5",
}
INPUT_DTYPES = tuple(_TL_NAMES)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# fp8 x fp8 pairs the kernels take: e4m3 x e4m3 and the gradient mixes with e5m2 that
# torch._scaled_mm accepts (e5m2 x e5m2 it refuses, and so do we)
FP8_PAIRS = ((torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.float8_e5m2),
             (torch.float8_e5m2, torch.float8_e4m3fn))
# Output dtypes: the input's own for 16/32-bit inputs; fp8 products round to one of these
# (bfloat16 by default, as torch._scaled_mm)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DEFAULT_OUT = torch.bfloat16
# fp8 MMAs (wgmma on sm_90) take K in steps of 32 bytes of operand and TMA rows of 16 bytes:
# K and N must be multiples of this (torch._scaled_mm asks the same)
FP8_MULTIPLE = 16

# Scale modes (the kernels' SCALE_A / SCALE_B constexprs): none, one fp32 value for the whole
# operand, one per row of a (``[M, 1]``) / per column of b (``[1, N]``).
SCALE_NONE = 0
SCALE_TENSOR = 1
SCALE_VECTOR = 2


def tl_name(dtype: torch.dtype) -> str:
    """The Triton type name of ``dtype``'s tiles (KeyError outside :data:`INPUT_DTYPES`)."""
    return _TL_NAMES[dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float8_e4m3fn`` -> ``"float8_e4m3fn"`` (for messages and cache keys)."""
    return str(dtype).removeprefix("torch.")


# The warp-specialized Gluon kernel (gemm_ws.py) takes these, output in the same dtype, unscaled;
# and fp8 (FP8_PAIRS, b K-major) with any scale modes into FP8_OUT_DTYPES (launch.ws_choice).
WS_DTYPES = (torch.bfloat16, torch.float16)
# The dtype the heuristics of tpfuse/gemm/config.py were measured in (their default argument).
HEURISTIC_DTYPE = torch.bfloat16
