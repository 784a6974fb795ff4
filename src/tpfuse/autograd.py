"""Autograd formulas for the three custom ops (``torch.ops.tpfuse.*``).

Registered with :func:`torch.library.register_autograd`, so eager autograd, ``torch.compile``
(AOTAutograd traces these backward functions) and CUDA graphs all see the same math.  Each
backward runs the *same concrete strategy* as its forward (the strategy is an op argument) and
is itself made of tpfuse ops, so the backward collectives are fused with their GEMMs too:

| forward | backward |
|---|---|
| ``c, a_full = ag_gemm(a_shard, b)`` | ``grad_a_shard = gemm_rs(grad_c, b.T)`` (+ ``reduce_scatter(grad_a_full)``); ``grad_b = a_full.T @ grad_c`` |
| ``c_shard = gemm_rs(a, b)`` | ``grad_a, grad_full = ag_gemm(grad_c_shard, b.T)``; ``grad_b = a.T @ grad_full`` |
| ``c = gemm_ar(a, b)`` | ``grad_a = grad_c @ b.T``; ``grad_b = a.T @ grad_c`` (no communication) |

These are the adjoints of all-gather (reduce-scatter), reduce-scatter (all-gather) and, for
``gemm_ar``, the Megatron convention that everything after an all-reduce is computed
identically on every rank, so ``grad_c`` is already the same everywhere and needs no reduction.

``grad_b`` is computed in the memory layout of ``b``: for ``b = weight.t()`` (the usual case)
it is ``(grad_c.T @ a_full).t()``, so the weight's gradient lands as a contiguous [N, K] matrix.

Importing this module registers the formulas (once); it has no other effect.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from tpfuse import ops as _ops  # noqa: F401  (defines the custom ops whose autograd is registered here)
from tpfuse._dist import resolve_group_name

# torch 2.13 renamed the tensor collectives (*_tensor -> *_single); older releases have only the old names.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

__all__ = ["weight_grad", "reduce_scatter_rows", "all_gather_rows", "all_reduce_sum", "group_world_size"]


# --------------------------------------------------------------------------------------------
# Helpers shared with tpfuse.nn (traceable by torch.compile, capturable by CUDA graphs)
# --------------------------------------------------------------------------------------------


def weight_grad(a: torch.Tensor, grad_c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a.T @ grad_c`` ([K, N], the gradient of ``b`` in ``a @ b``), laid out like ``b``.

    When ``b`` is a transposed view (``weight.t()``: stride(0) == 1) the product is computed as
    ``(grad_c.T @ a).t()``, so that the gradient of the underlying [N, K] weight is contiguous.
    """
    if b.dim() == 2 and b.stride(0) == 1 and b.stride(1) != 1:
        return torch.matmul(grad_c.t(), a).t()
    return torch.matmul(a.t(), grad_c)


def reduce_scatter_rows(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """Rows ``rank*M/W .. (rank+1)*M/W`` of the sum over ranks of ``x`` [M, ...] (sum reduction).

    bf16/fp16 are summed in float32 (as the tpfuse ops do), then rounded once.
    """
    if world_size == 1:
        return x.clone()
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = _reduce_scatter(x.contiguous().to(acc), "sum", 0, group_name)
    return funcol.wait_tensor(out).to(x.dtype)


def all_gather_rows(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """Concatenation over ranks (in group-rank order) of ``x`` [m, ...] along dim 0."""
    if world_size == 1:
        return x.clone()
    return funcol.wait_tensor(_all_gather(x.contiguous(), 0, group_name))


def all_reduce_sum(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """Sum over ranks of ``x`` (bf16/fp16 summed in float32, then rounded once)."""
    if world_size == 1:
        return x
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = funcol.all_reduce(x.contiguous().to(acc), "sum", group_name)
    return funcol.wait_tensor(out).to(x.dtype)


def group_world_size(group_name: str) -> int:
    """World size of the process group registered under ``group_name``."""
    return torch.distributed.get_world_size(resolve_group_name(group_name))


# --------------------------------------------------------------------------------------------
# ag_gemm
# --------------------------------------------------------------------------------------------


# The activation operand (a_full, a) is saved only when the weight needs a gradient: with a
# frozen weight (inference, adapters) backward needs b alone, and the activation is freed.


def _ag_gemm_setup(ctx, inputs, output):
    _, b, group_name, strategy = inputs
    _, a_full = output
    ctx.save_for_backward(a_full if ctx.needs_input_grad[1] else None, b)
    ctx.group_name, ctx.strategy = group_name, strategy
    ctx.rows = a_full.shape[0]


def _ag_gemm_backward(ctx, grad_c, grad_a_full):
    a_full, b = ctx.saved_tensors
    grad_a_shard = grad_b = None
    if grad_c is None:  # only a_full was used
        grad_c = b.new_zeros((ctx.rows, b.shape[1]))
    if ctx.needs_input_grad[0]:
        grad_a_shard = torch.ops.tpfuse.gemm_rs(grad_c, b.t(), ctx.group_name, ctx.strategy)
        if grad_a_full is not None:
            world_size = group_world_size(ctx.group_name)
            grad_a_shard = grad_a_shard + reduce_scatter_rows(grad_a_full, ctx.group_name, world_size)
    if ctx.needs_input_grad[1]:
        grad_b = weight_grad(a_full, grad_c, b)
    return grad_a_shard, grad_b, None, None


# --------------------------------------------------------------------------------------------
# gemm_rs
# --------------------------------------------------------------------------------------------


def _gemm_rs_setup(ctx, inputs, output):
    a, b, group_name, strategy = inputs
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b)
    ctx.group_name, ctx.strategy = group_name, strategy


def _gemm_rs_backward(ctx, grad_c_shard):
    a, b = ctx.saved_tensors
    grad_a, grad_full = torch.ops.tpfuse.ag_gemm(grad_c_shard, b.t(), ctx.group_name, ctx.strategy)
    grad_b = weight_grad(a, grad_full, b) if ctx.needs_input_grad[1] else None
    return (grad_a if ctx.needs_input_grad[0] else None), grad_b, None, None


# --------------------------------------------------------------------------------------------
# gemm_ar
# --------------------------------------------------------------------------------------------


def _gemm_ar_setup(ctx, inputs, output):
    a, b, _, _ = inputs
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b)


def _gemm_ar_backward(ctx, grad_c):
    a, b = ctx.saved_tensors
    grad_a = torch.matmul(grad_c, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = weight_grad(a, grad_c, b) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None, None


def _register() -> None:
    torch.library.register_autograd("tpfuse::ag_gemm", _ag_gemm_backward, setup_context=_ag_gemm_setup)
    torch.library.register_autograd("tpfuse::gemm_rs", _gemm_rs_backward, setup_context=_gemm_rs_setup)
    torch.library.register_autograd("tpfuse::gemm_ar", _gemm_ar_backward, setup_context=_gemm_ar_setup)


_register()
