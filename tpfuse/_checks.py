"""Input validation for the three ops, and the cross-rank agreement check.

Validation is local and pure (shapes, dtypes, devices, names): it runs on every rank before
any communication, so bad input that every rank shares fails on every rank at once.  Bad input
on *some* ranks only would leave the others waiting in a collective; the agreement check
(:func:`agree`) closes that hole by exchanging a fixed-size signature of each rank's call
first, so that a mismatch or a local error becomes a ``ValueError`` on every rank.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from tpfuse._dist import GroupContext, all_gather_rows
from tpfuse.strategies import STRATEGY_NAMES  # the registry (tpfuse/strategies/__init__.py)

__all__ = ["OPS", "STRATEGY_NAMES", "check_call", "agreement_enabled", "agree", "signature"]

OPS = ("ag_gemm", "gemm_rs", "gemm_ar")
_FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_REFERENCE_DTYPES = (torch.float64,)  # unfused and ring only
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4}
_OPERANDS = {
    "ag_gemm": ("a_shard", "[M/W, K]"),
    "gemm_rs": ("a", "[M, K]"),
    "gemm_ar": ("a", "[M, K]"),
}


def _check_matrix(op: str, name: str, layout: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(
            f"{op}: {name} must be a 2-D matrix {layout}, got shape {tuple(x.shape)}; "
            f"flatten leading dims first (x.reshape(-1, x.shape[-1])) or use tpfuse.nn layers"
        )
    return x


def check_call(op: str, a: object, b: object, ctx: GroupContext, strategy: object) -> None:
    """Raise ``TypeError``/``ValueError`` for a call that no strategy may run.

    Checks only this rank's arguments (no communication).  Strategy *availability* is checked
    separately by :func:`tpfuse.strategies.why_unavailable`.
    """
    a_name, a_layout = _OPERANDS[op]
    a = _check_matrix(op, a_name, a_layout, a)
    b = _check_matrix(op, "b", "[K, N]", b)
    if a.dtype != b.dtype:
        raise TypeError(
            f"{op}: {a_name} is {a.dtype} but b is {b.dtype}; cast one of them (b.to({a_name}.dtype))"
        )
    if a.dtype not in _FAST_DTYPES + _REFERENCE_DTYPES:
        raise TypeError(
            f"{op}: dtype {a.dtype} is not supported; use bfloat16, float16 or float32 "
            f"(float64 with strategy='unfused' or 'ring')"
        )
    if a.device != b.device:
        raise ValueError(f"{op}: {a_name} is on {a.device} but b is on {b.device}; move both to one device")
    if ctx.device_type == "cuda" and a.device.type != "cuda":
        raise ValueError(
            f"{op}: the group's backend is {ctx.backend!r}, which needs CUDA tensors, but "
            f"{a_name} is on {a.device}; move the inputs to the rank's GPU"
        )
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"{op}: inner dimensions differ: {a_name} is {tuple(a.shape)} {a_layout} and b is "
            f"{tuple(b.shape)} [K, N], so K = {a.shape[1]} vs {b.shape[0]}; pass b as [K, N] "
            f"(for an nn.Linear weight [N, K], pass weight.t())"
        )
    if op == "gemm_rs" and a.shape[0] % ctx.world_size != 0:
        raise ValueError(
            f"gemm_rs: M = {a.shape[0]} rows of a must be divisible by the world size "
            f"{ctx.world_size} (each rank gets M/W rows of the result); pad M to "
            f"{-(-a.shape[0] // ctx.world_size) * ctx.world_size}"
        )
    if not isinstance(strategy, str):
        raise TypeError(f"{op}: strategy must be a string, got {type(strategy).__name__}")
    if strategy != "auto" and strategy not in STRATEGY_NAMES:
        raise ValueError(
            f"{op}: unknown strategy {strategy!r}; choose one of {', '.join(STRATEGY_NAMES)} or 'auto'"
        )
    if a.dtype in _REFERENCE_DTYPES and strategy not in ("auto", "unfused", "ring"):
        raise ValueError(
            f"{op}: {a.dtype} runs only with strategy 'unfused' or 'ring' (a reference dtype); "
            f"got {strategy!r}"
        )


@functools.lru_cache(maxsize=1)
def _debug_setting() -> str | None:
    return os.environ.get("TPFUSE_DEBUG")


def agreement_enabled(ctx: GroupContext) -> bool:
    """Whether to run :func:`agree` before each op.

    ``TPFUSE_DEBUG=1`` forces it on, ``TPFUSE_DEBUG=0`` off.  Unset: on for CPU backends
    (gloo, where one tiny all_gather costs little next to a CPU GEMM), off for NCCL, where it
    would add a latency-bound collective to every call.  Never under torch.compile tracing.
    """
    if ctx.world_size == 1 or torch.compiler.is_compiling():
        return False
    setting = _debug_setting()
    if setting is not None:
        return setting not in ("0", "", "false", "False")
    return ctx.device_type != "cuda"


_SIG_LEN = 8


def signature(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor, extra: int) -> list[int]:
    """Fixed-size summary of a call; ranks must agree on every field except the local-only ones.

    Fields: op, resolved strategy, dtype, rows of a, K (ag_gemm only: equal everywhere),
    N (gemm_rs/gemm_ar only: equal everywhere), extra (return_gathered), 0.
    For ag_gemm N may differ per rank (each rank's own column block); for gemm_rs/gemm_ar K may.
    """
    k_agreed = a.shape[1] if op == "ag_gemm" else -1
    n_agreed = b.shape[1] if op != "ag_gemm" else -1
    return [
        OPS.index(op), STRATEGY_NAMES.index(strategy), _DTYPE_CODES[a.dtype],
        a.shape[0], k_agreed, n_agreed, extra, 0,
    ]


_FIELDS = ("op", "strategy", "dtype", "rows of a", "K", "N", "return_gathered", "-")


def agree(ctx: GroupContext, op: str, error: Exception | None, signature: list[int] | None) -> None:
    """Exchange this rank's call signature (or its local error) with the group; raise on all
    ranks if any rank failed validation or the signatures differ.

    One all_gather of ``world_size * 9`` int64s, plus an object all_gather of the error texts
    only when some rank failed.  Every rank calls it in the same place, so it cannot hang on
    disagreement.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if ctx.device_type == "cuda" else torch.device("cpu")
    mine = torch.tensor([1 if error is None else 0] + (signature or [0] * _SIG_LEN), dtype=torch.int64, device=device)
    gathered = torch.empty(ctx.world_size * (_SIG_LEN + 1), dtype=torch.int64, device=device)
    all_gather_rows(gathered, mine, ctx.group)
    rows = gathered.view(ctx.world_size, _SIG_LEN + 1).cpu().tolist()
    bad = [r for r, row in enumerate(rows) if row[0] == 0]
    if bad:
        texts: list[object] = [None] * ctx.world_size
        dist.all_gather_object(texts, None if error is None else f"{type(error).__name__}: {error}", group=ctx.group)
        if error is not None:
            raise error
        details = "; ".join(f"rank {r}: {texts[r]}" for r in bad)
        raise ValueError(f"{op}: invalid input on rank(s) {bad} of the group ({details}); no communication was started")
    first = rows[0][1:]
    for r, row in enumerate(rows[1:], start=1):
        for field, x, y in zip(_FIELDS, first, row[1:]):
            if x != y:
                shown = (STRATEGY_NAMES[x], STRATEGY_NAMES[y]) if field == "strategy" else (x, y)
                raise ValueError(
                    f"{op}: ranks disagree on {field}: rank 0 has {shown[0]}, rank {r} has {shown[1]} "
                    f"(every rank must call {op} with the same shapes, dtype and strategy)"
                )
