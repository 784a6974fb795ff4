"""Strategies: one module per schedule, all with the same three functions and the same meaning.

Each strategy module provides::

    ag_gemm(a_shard, b, ctx) -> (c, a_full)     # a_shard [M/W, K], b [K, N]  -> [M, N], [M, K]
    gemm_rs(a, b, ctx) -> c_shard               # a [M, K], b [K, N]          -> [M/W, N]
    gemm_ar(a, b, ctx) -> c                     # a [M, K], b [K, N]          -> [M, N]

Inputs are validated by :mod:`tpfuse.ops` before a strategy sees them; outputs are always
freshly allocated (never an alias of an input).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from tpfuse._checks import STRATEGY_NAMES
from tpfuse._dist import GroupContext

__all__ = ["STRATEGY_NAMES", "get", "why_unavailable", "runnable", "implemented"]

_IMPLEMENTED = ("unfused", "ring")


def implemented() -> tuple[str, ...]:
    """Names of the strategies this build contains (the planner chooses only among these)."""
    return _IMPLEMENTED


def get(name: str) -> ModuleType:
    """The strategy module ``tpfuse.strategies.<name>``."""
    if name not in _IMPLEMENTED:
        raise ValueError(f"strategy {name!r} is not implemented; choose one of {', '.join(_IMPLEMENTED)}")
    return importlib.import_module(f"tpfuse.strategies.{name}")


def why_unavailable(name: str, ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if strategy ``name`` can run here, else a sentence saying why not."""
    if name in ("unfused", "ring"):
        return None
    if name in ("copy_engine", "fused"):
        if device.type != "cuda":
            return f"{name} needs CUDA symmetric memory; the inputs are on {device} and this group is {ctx.backend}"
        if dtype == torch.float64:
            return f"{name} runs bfloat16/float16/float32 only; float64 runs with 'unfused' or 'ring'"
        return (
            f"{name} is not part of this tpfuse build yet (the symmetric-memory strategies are "
            f"still being written); use 'ring' or 'unfused'"
        )
    raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGY_NAMES)}")


def runnable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """Strategies that can run for this group, device and dtype (always includes 'unfused')."""
    return tuple(s for s in STRATEGY_NAMES if why_unavailable(s, ctx, device, dtype) is None)
