"""The dtype policy: which dtypes each strategy takes, what it returns, and in which dtype it
accumulates and reduces.  Every other module asks this one; no dtype table lives elsewhere
(the GEMM core's own kernel facts stay in ``tpfuse/gemm`` and ``tpfuse/kernels``).

A strategy declares its entry as ``DTYPES``: a tuple of :class:`Rule`, one per group of input
dtypes that behave alike::

    Rule(inputs=(torch.bfloat16, torch.float16))            # out = input, accumulate and reduce fp32
    Rule(inputs=(torch.float64,), accumulate=torch.float64, reduce=torch.float64)
    Rule(inputs=(torch.float8_e4m3fn,), out_dtypes=(torch.bfloat16,), scales=("scale_a", "scale_b"))

``out_dtypes=None`` means the output has the input's dtype; ``scales`` names the scale tensors
an input of that dtype takes (none for today's dtypes).  Adding a dtype to a strategy is one
more ``Rule`` in its declaration.

The model (``tpfuse.model``) names dtypes by short names (``"bf16"``); :func:`name`,
:func:`torch_dtype` and :func:`itemsize` translate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["Rule", "HALF", "FLOAT32", "FLOAT64", "FP8", "FAST", "EVERY", "name", "torch_dtype", "itemsize",
           "rule", "accepts", "inputs", "out_dtype", "accumulate", "reduce_dtype", "default", "rounding_floor",
           "describe"]

# short name -> torch dtype, and the spellings users may pass for each
_SHORT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
          "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
            "float64": "fp64", "double": "fp64", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}
# What a correct result may differ from the float64 reference by (relative to its scale), even
# where the baseline happens to be exact: about one rounding of the output dtype.
_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


@dataclass(frozen=True)
class Rule:
    """How a strategy treats inputs of the dtypes ``inputs``.

    ``out_dtypes``: the output dtypes it can write (None: the input's own); ``accumulate``: the
    GEMM's accumulator; ``reduce``: the dtype partial sums cross ranks in (RS, AR);
    ``scales``: names of the scale tensors an input of this dtype takes (fp8)."""

    inputs: tuple[torch.dtype, ...]
    out_dtypes: Optional[tuple[torch.dtype, ...]] = None
    accumulate: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32
    scales: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.inputs or not all(isinstance(d, torch.dtype) for d in self.inputs):
            raise TypeError(f"Rule.inputs: a non-empty tuple of torch dtypes, got {self.inputs!r}")


# The entries our strategies declare.
HALF = Rule(inputs=(torch.bfloat16, torch.float16))
FLOAT32 = Rule(inputs=(torch.float32,))
FLOAT64 = Rule(inputs=(torch.float64,), accumulate=torch.float64, reduce=torch.float64)
# fp8 (e4m3; e5m2 for gradients) with the scales and output dtypes of torch._scaled_mm; the legal
# pairs, scale shapes and size rule are tpfuse/_fp8.py's checks
FP8 = Rule(inputs=(torch.float8_e4m3fn, torch.float8_e5m2), out_dtypes=(torch.bfloat16, torch.float16, torch.float32),
           scales=("scale_a", "scale_b"))
FAST = (HALF, FLOAT32)              # the Triton-free symmetric-memory path (cuBLAS per chunk)
EVERY = (HALF, FLOAT32, FLOAT64)    # torch.distributed strategies: float64 too (reference checks)


def name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bf16"`` (the model's names)."""
    key = str(dtype).removeprefix("torch.").lower() if dtype is not None else "None"
    key = _ALIASES.get(key, key)
    if key not in _SHORT:
        raise ValueError(f"dtype: {dtype!r} is not supported; use torch.bfloat16, torch.float16, "
                         "torch.float32 or torch.float64 (or 'bf16', 'fp16', 'fp32', 'fp64')")
    return key


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a name or dtype (``"bf16"`` -> ``torch.bfloat16``)."""
    return dtype if isinstance(dtype, torch.dtype) else _SHORT[name(dtype)]


@functools.lru_cache(maxsize=64)
def itemsize(dtype: Any) -> int:
    """Bytes per element."""
    return torch_dtype(dtype).itemsize


def rule(rules: tuple[Rule, ...], dtype: Any) -> Optional[Rule]:
    """The rule of ``rules`` (a strategy's ``DTYPES``) for inputs of ``dtype``; None: not taken."""
    d = torch_dtype(dtype)
    return next((r for r in rules if d in r.inputs), None)


def accepts(rules: tuple[Rule, ...], dtype: Any) -> bool:
    return rule(rules, dtype) is not None


def inputs(rules: tuple[Rule, ...]) -> tuple[torch.dtype, ...]:
    """Every input dtype of ``rules``, in declaration order."""
    return tuple(d for r in rules for d in r.inputs)


def _default(dtype: Any) -> Rule:
    r = rule(EVERY + (FP8,), dtype)
    if r is None:
        raise ValueError(f"dtype: {dtype!r} has no default rule; name a strategy's DTYPES")
    return r


def out_dtype(dtype: Any, rules: tuple[Rule, ...] = EVERY) -> torch.dtype:
    """The output dtype for inputs of ``dtype`` (the rule's first ``out_dtypes``, else the input's)."""
    r = rule(rules, dtype) or _default(dtype)
    return r.out_dtypes[0] if r.out_dtypes else torch_dtype(dtype)


def accumulate(dtype: Any, rules: tuple[Rule, ...] = EVERY) -> torch.dtype:
    return (rule(rules, dtype) or _default(dtype)).accumulate


def reduce_dtype(dtype: Any, rules: tuple[Rule, ...] = EVERY) -> torch.dtype:
    """The dtype partial sums of ``dtype`` products are reduced across ranks in."""
    return (rule(rules, dtype) or _default(dtype)).reduce


def default(device_type: str) -> torch.dtype:
    """The dtype the demo and the benches run when none is named: bfloat16 on GPU, float32 on
    CPU (CPU bfloat16 matmuls are slow and tell nothing)."""
    return torch.bfloat16 if device_type == "cuda" else torch.float32


def rounding_floor(dtype: torch.dtype) -> float:
    """About one rounding of ``dtype`` relative to the result's scale (test tolerances)."""
    return _FLOOR[dtype]


def describe(rules: tuple[Rule, ...]) -> str:
    """``"bfloat16/float16/float32"``: the input dtypes of ``rules`` for messages."""
    return "/".join(str(d).removeprefix("torch.") for d in inputs(rules))
