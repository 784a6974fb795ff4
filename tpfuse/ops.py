"""The three public ops: validate -> choose a strategy -> dispatch.

| op | per-rank input | per-rank output | unfused meaning |
|---|---|---|---|
| ``ag_gemm`` | ``a_shard [M/W, K]``, ``b [K, N]`` | ``c [M, N]`` (and ``a_full [M, K]``) | ``all_gather(a_shard, dim=0) @ b`` |
| ``gemm_rs`` | ``a [M, K]``, ``b [K, N]`` | ``c_shard [M/W, N]`` | ``reduce_scatter_sum(a @ b, dim=0)`` |
| ``gemm_ar`` | ``a [M, K]``, ``b [K, N]`` | ``c [M, N]`` | ``all_reduce_sum(a @ b)`` |

K and N are this rank's local sizes.  Each op is also a ``torch.library`` custom op
(``torch.ops.tpfuse.ag_gemm`` etc., taking the group by name) with a fake implementation, so
``torch.compile`` traces it as one node and CUDA graphs can capture it.
"""

from __future__ import annotations


import operator

import torch
import torch.distributed as dist

from tpfuse import _checks, strategies
from tpfuse._dist import GroupContext, group_context, resolve_group_name

__all__ = ["ag_gemm", "gemm_rs", "gemm_ar", "resolve_strategy", "traced_strategy"]


# --------------------------------------------------------------------------------------------
# Custom ops: the dispatch target of the public functions (group passed by name).
# --------------------------------------------------------------------------------------------


def _context_by_name(group_name: str) -> GroupContext:
    # Not cached: a destroyed and re-created group may come back under the same name.
    return group_context(resolve_group_name(group_name))


@torch.library.custom_op("tpfuse::ag_gemm", mutates_args=())
def _ag_gemm_op(a_shard: torch.Tensor, b: torch.Tensor, group_name: str, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather ``a_shard`` [M/W, K] over the group, multiply by ``b`` [K, N]: returns (c [M, N], a_full [M, K])."""
    return strategies.get(strategy).ag_gemm(a_shard, b, _context_by_name(group_name))


@_ag_gemm_op.register_fake
def _(a_shard, b, group_name, strategy):
    world_size = _context_by_name(group_name).world_size
    m = a_shard.shape[0] * world_size
    return a_shard.new_empty((m, b.shape[1])), a_shard.new_empty((m, a_shard.shape[1]))


@torch.library.custom_op("tpfuse::gemm_rs", mutates_args=())
def _gemm_rs_op(a: torch.Tensor, b: torch.Tensor, group_name: str, strategy: str) -> torch.Tensor:
    """Reduce-scatter (sum) of ``a`` [M, K] @ ``b`` [K, N] over the group: returns c_shard [M/W, N]."""
    return strategies.get(strategy).gemm_rs(a, b, _context_by_name(group_name))


@_gemm_rs_op.register_fake
def _(a, b, group_name, strategy):
    world_size = _context_by_name(group_name).world_size
    return a.new_empty((a.shape[0] // world_size, b.shape[1]))


@torch.library.custom_op("tpfuse::gemm_ar", mutates_args=())
def _gemm_ar_op(a: torch.Tensor, b: torch.Tensor, group_name: str, strategy: str) -> torch.Tensor:
    """All-reduce (sum) of ``a`` [M, K] @ ``b`` [K, N] over the group: returns c [M, N]."""
    return strategies.get(strategy).gemm_ar(a, b, _context_by_name(group_name))


@_gemm_ar_op.register_fake
def _(a, b, group_name, strategy):
    return a.new_empty((a.shape[0], b.shape[1]))


# --------------------------------------------------------------------------------------------
# Strategy choice
# --------------------------------------------------------------------------------------------


def _problem_size(op: str, a: torch.Tensor, b: torch.Tensor, world_size: int) -> tuple[int, int, int]:
    """(m, n, k) as the planner takes them: m is the full M, n and k are local."""
    m = a.shape[0] * world_size if op == "ag_gemm" else a.shape[0]
    return m, b.shape[1], a.shape[1]


def resolve_strategy(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> str:
    """The concrete strategy a call runs: ``strategy`` itself if it can run here (else a
    ``ValueError`` saying why), or the planner's choice among the runnable ones for ``"auto"``."""
    if strategy != "auto":
        reason = strategies.why_unavailable(strategy, ctx, a.device, a.dtype)
        if reason is not None:
            raise ValueError(f"{op}: strategy {strategy!r} cannot run here: {reason}")
        return strategy
    candidates = strategies.runnable(ctx, a.device, a.dtype)
    m, n, k = _problem_size(op, a, b, ctx.world_size)
    return _auto_choice(op, m, n, k, ctx.world_size, a.dtype, a.device, candidates)


def _auto_choice(op: str, m: int, n: int, k: int, world_size: int, dtype: torch.dtype, device: torch.device,
                 candidates: tuple[str, ...]) -> str:
    """The planner's pick (cached inside :func:`tpfuse.plan.choose`; deterministic, so every rank
    that sees the same shapes picks the same strategy)."""
    from tpfuse.model.hardware import detect, get_profile
    from tpfuse.plan import choose

    hardware = detect(device) if device.type == "cuda" else get_profile("cpu-gloo")
    return choose(op, m=m, n=n, k=k, world_size=world_size, dtype=dtype, hardware=hardware,
                  candidates=candidates).strategy


@torch.compiler.assume_constant_result
def _strategy_for_shapes(op: str, strategy: str, m: int, k: int, n: int, dtype: torch.dtype,
                         device: torch.device, group_name: str) -> str:
    """:func:`resolve_strategy` for ``a`` [m, k] and ``b`` [k, n] from plain values.

    The planner behind "auto" reads files and caches, which Dynamo cannot trace; marked as a
    constant result, it runs once at trace time and its answer is baked into the graph.  The
    stand-in operands are one-element tensors expanded to the shapes (only shape, dtype and
    device are read).
    """
    def stand_in(shape: tuple[int, int]) -> torch.Tensor:
        return torch.empty((), dtype=dtype, device=device).expand(shape)

    return resolve_strategy(op, strategy, stand_in((m, k)), stand_in((k, n)),
                            group_context(resolve_group_name(group_name)))


def traced_strategy(op: str, strategy: str, a: torch.Tensor, b: torch.Tensor, ctx: GroupContext) -> str:
    """The strategy under ``torch.compile``: fixed at trace time.

    A named strategy does not depend on sizes, so shapes stay dynamic.  For "auto",
    ``operator.index`` specializes the symbolic sizes (with a guard): the graph is valid for the
    sizes its strategy was chosen for and recompiles for others.
    """
    m = k = n = 1
    if strategy == "auto":
        m, k, n = (operator.index(size) for size in (a.shape[0], a.shape[1], b.shape[1]))
    return _strategy_for_shapes(op, strategy, m, k, n, b.dtype, b.device, ctx.group_name)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _prepare(op: str, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None, strategy: str,
             extra: int = 0) -> tuple[GroupContext, str]:
    """Validate locally, resolve the strategy, and (when enabled) agree with the other ranks.

    Every error is raised before any data moves; with the agreement check on, it is raised on
    every rank of the group.
    """
    ctx = group_context(group)
    if torch.compiler.is_compiling():  # local checks become guards; no cross-rank exchange
        _checks.check_call(op, a, b, ctx, strategy)
        return ctx, traced_strategy(op, strategy, a, b, ctx)
    error: Exception | None = None
    chosen = "unfused"
    try:
        _checks.check_call(op, a, b, ctx, strategy)
        chosen = resolve_strategy(op, strategy, a, b, ctx)
    except (TypeError, ValueError) as exc:
        error = exc
    if _checks.agreement_enabled(ctx):
        signature = None if error is not None else _checks.signature(op, chosen, a, b, extra)
        _checks.agree(ctx, op, error, signature)
    elif error is not None:
        raise error
    return ctx, chosen


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *,
            strategy: str = "auto", return_gathered: bool = False):
    """AllGather + GEMM: ``all_gather(a_shard, dim=0) @ b``.

    | tensor | shape | sharding |
    |---|---|---|
    | ``a_shard`` | [M/W, K] | rows of A, rank r holds rows r*M/W .. (r+1)*M/W |
    | ``b`` | [K, N] | this rank's own (e.g. ``weight.t()`` of a column-parallel [N, K] weight) |
    | returns ``c`` | [M, N] | all rows, this rank's columns |
    | ``a_full`` (``return_gathered=True``) | [M, K] | the gathered A, bit-exact copy of every shard |

    ``strategy``: "auto" (the planner), "unfused", "ring", "copy_engine", "fused".
    """
    if not isinstance(return_gathered, bool):
        raise TypeError(f"ag_gemm: return_gathered must be a bool, got {type(return_gathered).__name__}")
    ctx, chosen = _prepare("ag_gemm", a_shard, b, group, strategy, int(return_gathered))
    c, a_full = torch.ops.tpfuse.ag_gemm(a_shard, b, ctx.group_name, chosen)
    return (c, a_full) if return_gathered else c


def gemm_rs(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *, strategy: str = "auto"):
    """GEMM + ReduceScatter: ``reduce_scatter_sum(a @ b, dim=0)``.

    | tensor | shape | sharding |
    |---|---|---|
    | ``a`` | [M, K] | all rows, this rank's K slice (K may differ per rank) |
    | ``b`` | [K, N] | this rank's K rows (e.g. ``weight.t()`` of a row-parallel [N, K] weight) |
    | returns ``c_shard`` | [M/W, N] | rows r*M/W .. (r+1)*M/W of the sum over ranks |

    M must be divisible by W.  bf16/fp16 partials are summed in float32, then rounded once.
    """
    ctx, chosen = _prepare("gemm_rs", a, b, group, strategy)
    return torch.ops.tpfuse.gemm_rs(a, b, ctx.group_name, chosen)


def gemm_ar(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None = None, *, strategy: str = "auto"):
    """GEMM + AllReduce: ``all_reduce_sum(a @ b)``.

    | tensor | shape | sharding |
    |---|---|---|
    | ``a`` | [M, K] | all rows, this rank's K slice |
    | ``b`` | [K, N] | this rank's K rows |
    | returns ``c`` | [M, N] | the full sum, equal on every rank |

    bf16/fp16 partials are summed in float32, then rounded once.
    """
    ctx, chosen = _prepare("gemm_ar", a, b, group, strategy)
    return torch.ops.tpfuse.gemm_ar(a, b, ctx.group_name, chosen)
