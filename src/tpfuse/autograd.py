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
    # Unused outputs get None, not zeros: a zero grad_a_full would cost a reduce-scatter of
    # [M, K] zeros in every backward (through torch's collectives: it broke the one-GPU bed's
    # CUDA-graph capture of the layers, whose gloo group cannot carry CUDA tensors).
    ctx.set_materialize_grads(False)
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


# --------------------------------------------------------------------------------------------
# fp8 layers: dynamic scaling + the scaled ops (torchao's float8 recipes, tpfuse._fp8.RECIPES)
# --------------------------------------------------------------------------------------------
#
# Scales are computed from the amax of what the *unsharded* layer would scale: where a scaled
# slice (a whole tensor, a token row, an output channel) is spread over the ranks, the amax is
# all-reduced (MAX) over the group first, as torchao does on DTensors and Transformer Engine over
# its amax-reduction group.  So a TP layer quantizes exactly as the unsharded layer in the same
# recipe, and every rank of an ag_gemm has the same tensor-wise scale.


def _all_reduce_max(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    if world_size == 1:
        return x
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "max", group_name))


def fp8_cast(x: torch.Tensor, granularity: str, dtype: torch.dtype, group_name: str, world_size: int, *,
             spread: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, cols] in fp8 with its dequantization scale: tensor-wise (0-d) or one per row
    ([rows, 1]).  ``spread``: the scaled slices continue on the other ranks (their amax is
    all-reduced).  Row-wise scales are powers of two (torchao's row-wise recipes round them)."""
    from tpfuse import _fp8

    rows = granularity == "rows"
    amax = x.abs().amax(dim=-1, keepdim=True) if rows else x.abs().amax()
    if spread:
        amax = _all_reduce_max(amax, group_name, world_size)
    return _fp8.quantize(x, dtype, "rows" if rows else "tensor", amax=amax, pow2=rows)


def _dequantize(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x8.float() * scale).to(dtype)


def _as_scale_b(scale: torch.Tensor) -> torch.Tensor:
    """A weight's per-output-channel scale [out, 1] as ``scale_b`` [1, out] of ``weight.t()``."""
    return scale.reshape(1, -1) if scale.dim() == 2 else scale


class Fp8ColumnParallel(torch.autograd.Function):
    """fp8 column-parallel GEMM ``y = x @ weight.T`` (bias outside).

    | | SP (``ag_gemm``) | no SP (local) |
    |---|---|---|
    | forward | ``ag_gemm(q(x_shard), q(w).T)`` | ``q(x) @ q(w).T`` |
    | ``grad_x`` | ``gemm_rs(q(grad_y), q_gi(w))`` | ``gemm_ar(q(grad_y), q_gi(w))`` |
    | ``grad_w`` | ``grad_y.T @ x_full`` in the layer's dtype | ``grad_y.T @ x`` |

    ``q``/``q_gi``: the recipe's casts (:data:`tpfuse._fp8.RECIPES`).  ``x_full`` is the
    dequantized fp8 input gathered by the forward op (``save_gathered_input=True``) or the
    high-precision input gathered again in backward (``False``).
    """

    @staticmethod
    def forward(ctx, x, weight, group_name: str, strategy: str, world_size: int, recipe: str,
                sequence_parallel: bool, save_gathered_input: bool):
        from tpfuse import _fp8

        (gx, dx), (gw, dw) = _fp8.RECIPES[recipe]["forward"]
        # tensor-wise: amax over every rank's tokens (SP) and every rank's output channels;
        # row-wise: token rows and output channels are whole on each rank.
        x8, sx = fp8_cast(x, gx, dx, group_name, world_size, spread=gx == "tensor" and sequence_parallel)
        w8, sw = fp8_cast(weight, gw, dw, group_name, world_size, spread=gw == "tensor")
        x_full = None
        if sequence_parallel:
            y, x8_full, sx_full = torch.ops.tpfuse.ag_gemm_scaled(x8, w8.t(), group_name, strategy, sx,
                                                                  _as_scale_b(sw), x.dtype)
            if ctx.needs_input_grad[1] and save_gathered_input:
                x_full = _dequantize(x8_full, sx_full, x.dtype)
        else:
            from tpfuse.strategies._scaled import mm

            y = mm(x8, w8.t(), sx, _as_scale_b(sw), x.dtype)
        if ctx.needs_input_grad[1] and x_full is None:
            x_full = x  # no SP: the replicated input; SP regather: the shard, gathered in backward
        ctx.save_for_backward(x_full, weight)
        ctx.args = (group_name, strategy, world_size, recipe, sequence_parallel, save_gathered_input)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        from tpfuse import _fp8

        x_saved, weight = ctx.saved_tensors
        group_name, strategy, world_size, recipe, sequence_parallel, save_gathered_input = ctx.args
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            (gg, dg), (gw, dw) = _fp8.RECIPES[recipe]["grad_input"]
            # grad_y [T, out/W]: its rows (and the whole tensor) continue on the other ranks
            g8, sg = fp8_cast(grad_y.contiguous(), gg, dg, group_name, world_size, spread=True)
            w8, sw = fp8_cast(weight, gw, dw, group_name, world_size, spread=gw == "tensor")
            op = torch.ops.tpfuse.gemm_rs_scaled if sequence_parallel else torch.ops.tpfuse.gemm_ar_scaled
            grad_x = op(g8, w8, group_name, strategy, sg, sw, grad_y.dtype)
        if ctx.needs_input_grad[1]:
            x_full = x_saved
            if sequence_parallel and not save_gathered_input:
                x_full = all_gather_rows(x_saved, group_name, world_size)
            grad_w = torch.matmul(grad_y.t(), x_full)
        return grad_x, grad_w, None, None, None, None, None, None


class Fp8RowParallel(torch.autograd.Function):
    """fp8 row-parallel GEMM ``y = x @ weight.T`` (bias outside).

    | | SP (``gemm_rs``) | no SP (``gemm_ar``) |
    |---|---|---|
    | forward | ``gemm_rs(q(x), q(w).T)`` | ``gemm_ar(q(x), q(w).T)`` |
    | ``grad_x`` | ``ag_gemm(q(grad_y_shard), q_gi(w))`` | ``q(grad_y) @ q_gi(w)``, local |
    | ``grad_w`` | ``grad_y_full.T @ x`` in the layer's dtype | ``grad_y.T @ x`` |

    ``grad_y_full`` is the dequantized fp8 output gradient gathered by the backward's ``ag_gemm``
    (``grad_y`` itself without SP).
    """

    @staticmethod
    def forward(ctx, x, weight, group_name: str, strategy: str, world_size: int, recipe: str,
                sequence_parallel: bool):
        from tpfuse import _fp8

        (gx, dx), (gw, dw) = _fp8.RECIPES[recipe]["forward"]
        # x [T, in/W] and weight [out, in/W]: token rows, output channels and the tensors all
        # continue on the other ranks (the input features are split)
        x8, sx = fp8_cast(x, gx, dx, group_name, world_size, spread=True)
        w8, sw = fp8_cast(weight, gw, dw, group_name, world_size, spread=True)
        op = torch.ops.tpfuse.gemm_rs_scaled if sequence_parallel else torch.ops.tpfuse.gemm_ar_scaled
        y = op(x8, w8.t(), group_name, strategy, sx, _as_scale_b(sw), x.dtype)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.args = (group_name, strategy, world_size, recipe, sequence_parallel)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        from tpfuse import _fp8

        x, weight = ctx.saved_tensors
        group_name, strategy, world_size, recipe, sequence_parallel = ctx.args
        (gg, dg), (gw, dw) = _fp8.RECIPES[recipe]["grad_input"]
        grad_y = grad_y.contiguous()
        # grad_y rows are whole on each rank; SP: the tensor continues on the others (its token
        # blocks), no SP: it is replicated
        g8, sg = fp8_cast(grad_y, gg, dg, group_name, world_size, spread=gg == "tensor" and sequence_parallel)
        w8, sw = fp8_cast(weight, gw, dw, group_name, world_size, spread=gw == "tensor")
        grad_full = grad_y
        if sequence_parallel:
            grad_x, g8_full, sg_full = torch.ops.tpfuse.ag_gemm_scaled(g8, w8, group_name, strategy, sg, sw,
                                                                       grad_y.dtype)
            if ctx.needs_input_grad[1]:
                grad_full = _dequantize(g8_full, sg_full, grad_y.dtype)
        else:
            from tpfuse.strategies._scaled import mm

            grad_x = mm(g8, w8, sg, sw, grad_y.dtype)
        grad_w = torch.matmul(grad_full.t(), x) if ctx.needs_input_grad[1] else None
        return (grad_x if ctx.needs_input_grad[0] else None), grad_w, None, None, None, None, None
