"""Tensor-parallel linear layers with sequence parallelism, built on the fused ops.

Megatron-style pairs: a :class:`ColumnParallelLinear` (fc1, QKV) feeds a
:class:`RowParallelLinear` (fc2, out-proj) with an elementwise op in between, so activations
stay sharded by feature between the two and no collective runs there:

    x_shard [T/W, h] --fc1: ag_gemm--> [T, ffn/W] --gelu--> [T, ffn/W] --fc2: gemm_rs--> [T/W, h]

Forward and backward collectives are fused with their GEMMs (the backward of ``ag_gemm`` is
``gemm_rs`` and vice versa, see :mod:`tpfuse.autograd`).  The layers call the custom ops
``torch.ops.tpfuse.*`` directly, with the group name taken once at construction and the
strategy resolved from shapes alone (no host sync), so ``torch.compile(fullgraph=True)`` traces
them without graph breaks and CUDA graphs can capture forward and backward.

Leading dimensions.  Inputs are ``[*lead, features]`` and are flattened to a matrix of
``prod(lead)`` token rows.  Sequence parallelism shards **dim 0** of the input: a column layer's
output has dim 0 multiplied by W (rank r's tokens are block r of it), a row layer's output has
dim 0 divided by W (so dim 0 must divide by W).  For Megatron's ``[S, B, H]`` layout that shards
the sequence; for ``[B, S, H]`` it shards the batch.  Without sequence parallelism the leading
shape passes through unchanged.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tpfuse import _checks, _fp8, strategies
from tpfuse import autograd as _autograd  # registers the custom ops' autograd formulas
from tpfuse._dist import GroupContext, group_context
from tpfuse.ops import resolve_strategy, traced_strategy

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


# --------------------------------------------------------------------------------------------
# autograd Functions for the two paths that are not a single custom op
# --------------------------------------------------------------------------------------------


class _AgGemmRegather(torch.autograd.Function):
    """Column SP forward that keeps only the input shard and gathers it again in backward.

    Saves ``W`` times less activation memory than keeping ``a_full``, at the cost of one more
    all-gather in backward.  Backward: ``grad_x_shard = gemm_rs(grad_c, weight)``,
    ``grad_weight = grad_c.T @ all_gather(x_shard)``.
    """

    @staticmethod
    def forward(ctx, x_shard, weight, group_name: str, strategy: str, world_size: int):
        c, _ = torch.ops.tpfuse.ag_gemm(x_shard, weight.t(), group_name, strategy)
        ctx.save_for_backward(x_shard if ctx.needs_input_grad[1] else None, weight)  # x: wgrad only
        ctx.group_name, ctx.strategy, ctx.world_size = group_name, strategy, world_size
        return c

    @staticmethod
    def backward(ctx, grad_c):
        x_shard, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.tpfuse.gemm_rs(grad_c, weight, ctx.group_name, ctx.strategy)
        if ctx.needs_input_grad[1]:
            x_full = _autograd.all_gather_rows(x_shard, ctx.group_name, ctx.world_size)
            grad_w = torch.matmul(grad_c.t(), x_full)
        return grad_x, grad_w, None, None, None


class _LinearDgradAllReduce(torch.autograd.Function):
    """Column forward without SP: a local GEMM on the replicated input; backward all-reduces the
    input gradient, fused with its GEMM: ``grad_x = gemm_ar(grad_c, weight)``."""

    @staticmethod
    def forward(ctx, x, weight, group_name: str, strategy: str):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)  # x: wgrad only
        ctx.group_name, ctx.strategy = group_name, strategy
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, grad_c):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.tpfuse.gemm_ar(grad_c, weight, ctx.group_name, ctx.strategy)
        if ctx.needs_input_grad[1]:
            grad_w = torch.matmul(grad_c.t(), x)
        return grad_x, grad_w, None, None


class _AllReduceGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group.

    For a parameter replicated on every rank but applied to a different token shard on each
    (the row layer's bias under SP): each rank's local gradient covers its own tokens only, the
    sum is the gradient an unsharded layer would get, and every replica receives it.
    """

    @staticmethod
    def forward(ctx, x, group_name: str, world_size: int):
        ctx.group_name, ctx.world_size = group_name, world_size
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _autograd.all_reduce_sum(grad, ctx.group_name, ctx.world_size), None, None


# --------------------------------------------------------------------------------------------
# Shared plumbing
# --------------------------------------------------------------------------------------------


def _check_positive_int(layer: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{layer}: {name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{layer}: {name} = {value} must be >= 1")
    return value


def _check_fp8(layer: str, fp8: object, sizes: dict[str, int]) -> str | None:
    """``fp8`` is None or a recipe of :data:`tpfuse._fp8.RECIPES`; every GEMM size the recipe
    feeds to a K or N dimension (``sizes``: name -> this rank's size) is a multiple of 16."""
    if fp8 is None:
        return None
    if not isinstance(fp8, str) or fp8 not in _fp8.RECIPES:
        raise ValueError(f"{layer}: fp8 = {fp8!r}; use None (no fp8), 'tensorwise' or 'rowwise'")
    for name, size in sizes.items():
        if size % _fp8.ALIGN:
            raise ValueError(
                f"{layer}: fp8 needs {name} = {size} to be a multiple of {_fp8.ALIGN} (a K or N of the "
                f"layer's fp8 GEMMs: the fp8 tensor cores' alignment); pad the layer or use fp8=None"
            )
    return fp8


def _fp8_stand_in(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of ``shape`` that reads nothing (the strategy choice reads shape, dtype, device)."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def _check_divisible(layer: str, name: str, value: int, world_size: int, what: str) -> int:
    if value % world_size != 0:
        lower = value // world_size * world_size
        upper = lower + world_size
        raise ValueError(
            f"{layer}: {name} = {value} must be divisible by the group's world size {world_size} "
            f"({what}); use {name} = {upper}" + (f" or {lower}" if lower > 0 else "")
            + " (pad the layer), or a group of a size that divides it"
        )
    return value // world_size


class _ParallelLinear(nn.Module):
    """What the two layers share: arguments, group, parameters, validation, strategy choice."""

    _flattened_rows_divisible = False  # row SP: dim 0 of the input must divide by W

    def __init__(self, in_features: int, out_features: int, bias: bool, group: dist.ProcessGroup | None,
                 sequence_parallel: bool, strategy: str, dtype: torch.dtype | None, device, *,
                 weight_shape: tuple[int, int], bias_shape: tuple[int, ...]):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.strategy = strategy
        self.weight = nn.Parameter(torch.empty(weight_shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(bias_shape, dtype=dtype, device=device)) if bias else None

    @staticmethod
    def _validated_args(layer: str, in_features, out_features, bias, group, sequence_parallel, strategy
                        ) -> GroupContext:
        _check_positive_int(layer, "in_features", in_features)
        _check_positive_int(layer, "out_features", out_features)
        for name, flag in (("bias", bias), ("sequence_parallel", sequence_parallel)):
            if not isinstance(flag, bool):
                raise TypeError(f"{layer}: {name} must be a bool, got {type(flag).__name__} ({flag!r})")
        if not isinstance(strategy, str):
            raise TypeError(f"{layer}: strategy must be a string, got {type(strategy).__name__}")
        if strategy != "auto" and strategy not in strategies.names():
            raise ValueError(
                f"{layer}: unknown strategy {strategy!r}; choose one of "
                f"{', '.join(strategies.names())} or 'auto'"
            )
        return group_context(group)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._ctx.world_size

    @property
    def rank(self) -> int:
        return self._ctx.rank

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"world_size={self.world_size}, sequence_parallel={self.sequence_parallel}, strategy={self.strategy!r}"
            + (f", fp8={self.fp8!r}" if self.fp8 is not None else "")
        )

    # -- per-call validation and strategy -----------------------------------------------------
    def _flatten(self, x: torch.Tensor, local_in: int) -> torch.Tensor:
        """``x`` [*lead, local_in] as a [tokens, local_in] matrix, after checking it fits this layer."""
        layer = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{layer}: input must be a torch.Tensor, got {type(x).__name__}")
        min_dim = 2 if self.sequence_parallel else 1
        if x.dim() < min_dim:
            raise ValueError(
                f"{layer}: input of shape {tuple(x.shape)} needs at least {min_dim} dims "
                f"([tokens, features]{' ; sequence parallelism shards dim 0' if min_dim == 2 else ''}); "
                f"add a leading dim (x.unsqueeze(0))"
            )
        if x.shape[-1] != local_in:
            what = "in_features" if local_in == self.in_features else \
                f"in_features / world_size = {self.in_features} / {self.world_size}"
            raise ValueError(
                f"{layer}: input's last dim is {x.shape[-1]} but this rank's layer takes {local_in} "
                f"({what}); input shape {tuple(x.shape)}"
            )
        if x.dtype != self.weight.dtype:
            raise TypeError(
                f"{layer}: input is {x.dtype} but the weight is {self.weight.dtype}; cast one "
                f"(x.to({self.weight.dtype}) or layer.to({x.dtype}))"
            )
        if x.device != self.weight.device:
            raise ValueError(
                f"{layer}: input is on {x.device} but the weight is on {self.weight.device}; move one of them"
            )
        if self._flattened_rows_divisible and self.sequence_parallel and x.shape[0] % self.world_size != 0:
            raise ValueError(
                f"{layer}: with sequence_parallel=True, dim 0 of the input ({x.shape[0]}, shape "
                f"{tuple(x.shape)}) must be divisible by the world size {self.world_size}: each rank "
                f"gets dim-0 block r of the output; pad dim 0 to "
                f"{-(-x.shape[0] // self.world_size) * self.world_size}"
            )
        return x.reshape(-1, local_in)

    def _fp8_call(self, op: str, a_shape: tuple[int, int], b_shape: tuple[int, int], gemm: str, device):
        """fp8 stand-ins of an op's operands and scales as the recipe's ``gemm`` casts them:
        (a, b, scaled kwargs).  Only shapes, dtypes and scale kinds are read."""
        (ga, da), (gb, db) = _fp8.RECIPES[self.fp8][gemm]
        scale_a = _fp8_stand_in((a_shape[0], 1) if ga == "rows" else (), torch.float32, device)
        scale_b = _fp8_stand_in((1, b_shape[1]) if gb == "rows" else (), torch.float32, device)
        return (_fp8_stand_in(a_shape, da, device), _fp8_stand_in(b_shape, db, device),
                dict(scale_a=scale_a, scale_b=scale_b, out_dtype=self.weight.dtype))

    def _choose_strategy(self, op: str, a: Callable[[torch.Tensor], torch.Tensor], b: torch.Tensor, local_in: int,
                         x: torch.Tensor, fp8_gemm: str | None = None) -> tuple[torch.Tensor, str]:
        """Validate ``x``, then resolve the concrete strategy of the op that ``(a, b)`` stand for.

        In eager mode, with the cross-rank agreement check on (CPU tensors on gloo by default, or
        ``TPFUSE_DEBUG=1``), a bad input on any rank raises on every rank before any
        communication.  Under ``torch.compile`` only local checks run (they become guards) and
        the strategy is fixed at trace time.
        ``a`` is a callable building the op's left operand from the flattened input.
        ``fp8_gemm``: the fp8 layers resolve the scaled op, with the operands that GEMM of the
        recipe casts ("forward" or "grad_input").
        """
        ctx = self._ctx
        scaled: dict = {}
        if fp8_gemm is not None:
            plain_a = a

            def a(x2d, _plain=plain_a):
                nonlocal b, scaled
                a_t = _plain(x2d)
                a_t, b, scaled = self._fp8_call(op, tuple(a_t.shape), tuple(b.shape), fp8_gemm, x2d.device)
                return a_t
        if torch.compiler.is_compiling():
            x2d = self._flatten(x, local_in)
            a_t = a(x2d)
            return x2d, traced_strategy(op, self.strategy, a_t, b, ctx, **scaled)
        if not _checks.agreement_enabled(ctx, getattr(getattr(x, "device", None), "type", None)):
            try:
                x2d = self._flatten(x, local_in)
                a_t = a(x2d)
            except (TypeError, ValueError) as exc:
                # posted, as the ops post theirs: peers deciding a new signature learn of it at
                # once instead of waiting out the round's timeout
                _checks.agree(ctx, f"{type(self).__name__} ({op})", exc, None)
                raise
            return x2d, resolve_strategy(op, self.strategy, a_t, b, ctx, **scaled)
        error: Exception | None = None
        x2d, chosen, signature = None, "unfused", None
        try:
            x2d = self._flatten(x, local_in)
            a_t = a(x2d)
            _checks.check_call(op, a_t, b, ctx, self.strategy, **scaled)
            chosen = resolve_strategy(op, self.strategy, a_t, b, ctx, **scaled)
            signature = _checks.signature(op, chosen, a_t, b, 0, **scaled)
        except (TypeError, ValueError) as exc:
            error = exc
        _checks.agree(ctx, f"{type(self).__name__} ({op})", error, signature)
        return x2d, chosen

    # -- loading from an unsharded layer ------------------------------------------------------
    def _shard_of(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        size = full.shape[dim] // self.world_size
        return full.narrow(dim, self.rank * size, size)

    def load_full_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of an unsharded ``weight`` [out_features, in_features] (and
        ``bias`` [out_features]) into the layer, e.g. from an ``nn.Linear`` or a checkpoint."""
        layer = type(self).__name__
        full = (self.out_features, self.in_features)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != full:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{layer}: the full weight must be [out_features, in_features] = {list(full)}, got {got}")
        if (bias is None) != (self.bias is None):
            raise ValueError(
                f"{layer}: the layer was built with bias={self.bias is not None} but bias "
                f"{'is None' if bias is None else 'was given'}; pass a bias iff the layer has one"
            )
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"{layer}: the full bias must be [out_features] = [{self.out_features}], got {tuple(bias.shape)}")
        with torch.no_grad():
            self.weight.copy_(self._shard_of(weight, self._weight_shard_dim))
            if bias is not None:
                self.bias.copy_(bias if self._bias_replicated else self._shard_of(bias, 0))

    @classmethod
    def from_full(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: dist.ProcessGroup | None = None,
                  **kwargs):
        """A layer holding this rank's shard of the unsharded ``weight`` [out, in] and ``bias``
        [out]; dtype and device follow ``weight``; ``kwargs`` go to the constructor."""
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias=bias is not None, group=group, dtype=weight.dtype,
                    device=weight.device, **kwargs)
        layer.load_full_weight(weight, bias)
        return layer


# --------------------------------------------------------------------------------------------
# The layers
# --------------------------------------------------------------------------------------------


def _posts_init_errors(init):
    """A layer's ``__init__`` that fails its argument checks on one rank posts the error to the
    group's next agreement round before raising, so the peers raise at their first call instead
    of waiting out the round's bound (issue 33.3).  A group that cannot be resolved has no peers
    to tell: the error is raised as it is."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except (TypeError, ValueError) as exc:
            try:
                group = signature.bind(self, *args, **kwargs).arguments.get("group")
                ctx = group_context(group)
            except Exception:  # noqa: BLE001 - no group to post to
                raise exc from None
            if ctx.world_size > 1:
                try:
                    _checks.agree(ctx, type(self).__name__, exc, None)   # posts, then raises exc
                except type(exc):
                    pass
            raise
    return wrapped


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ weight.T + bias`` with the output features split over the group.

    Rank r holds rows ``r*out/W .. (r+1)*out/W`` of the full [out, in] weight and the same slice
    of the bias.  ``T`` is the number of tokens (the product of the input's leading dims) and
    "block r" the r-th of W equal parts.

    Forward (``sequence_parallel=True``: ``ag_gemm``; ``False``: a local GEMM):

    | tensor | shape (per rank) | sharding |
    |---|---|---|
    | input ``x`` | [T/W, in] (SP) / [T, in] | SP: token block r; else replicated |
    | ``weight`` | [out/W, in] | output-feature block r |
    | ``bias`` | [out/W] | output-feature block r |
    | output ``y`` | [T, out/W] | all tokens, output-feature block r |

    Backward:

    | gradient | shape (per rank) | how |
    |---|---|---|
    | ``grad_x`` (SP) | [T/W, in] | ``gemm_rs(grad_y, weight)``: reduce-scatter fused with the dgrad GEMM |
    | ``grad_x`` (no SP) | [T, in] | ``gemm_ar(grad_y, weight)``: all-reduce fused with the dgrad GEMM |
    | ``grad_weight`` | [out/W, in] | ``grad_y.T @ x_full``, local; ``x_full`` kept from forward (``save_gathered_input=True``) or gathered again |
    | ``grad_bias`` | [out/W] | ``grad_y.sum(0)``, local |

    Leading dims: input ``[d0, *rest, in]`` gives ``[W*d0, *rest, out/W]`` with SP (rank r's
    input is block r of the output's dim 0), ``[d0, *rest, out/W]`` without.

    Args:
        in_features, out_features: sizes of the full (unsharded) layer; ``out_features`` must
            divide by W.
        bias: learn a (sharded) bias.
        group: the tensor-parallel process group (None = WORLD).
        sequence_parallel: the input is sharded by tokens (dim 0) and gathered here (True), or
            replicated on every rank (False, Megatron TP without SP).
        strategy: "auto" or a strategy name for the fused ops; backward uses the same one.
        save_gathered_input: keep the gathered input for the weight gradient (memory
            ``T x in`` per layer), or keep only the shard and gather it again in backward
            (``W`` times less activation memory, one more all-gather).  SP only.
        fp8: None, "tensorwise" or "rowwise": the forward and the input-gradient GEMMs run in
            fp8 through the scaled ops, with dynamic scales (:data:`tpfuse._fp8.RECIPES`,
            docs/nn.md "fp8"); the weight gradient runs in the parameters' dtype.  ``in_features``
            and ``out_features / W`` must be multiples of 16.
        dtype, device: of the parameters.
    """

    _weight_shard_dim = 0
    _bias_replicated = False

    @_posts_init_errors
    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = True, strategy: str = "auto", save_gathered_input: bool = True,
                 dtype: torch.dtype | None = None, device=None, fp8: str | None = None):
        ctx = self._validated_args("ColumnParallelLinear", in_features, out_features, bias, group,
                                   sequence_parallel, strategy)
        if not isinstance(save_gathered_input, bool):
            raise TypeError(f"ColumnParallelLinear: save_gathered_input must be a bool, got {save_gathered_input!r}")
        out_local = _check_divisible("ColumnParallelLinear", "out_features", out_features, ctx.world_size,
                                     "each rank holds out_features / world_size output features")
        fp8 = _check_fp8("ColumnParallelLinear", fp8, {"in_features": in_features,
                                                        "out_features / world_size": out_local})
        super().__init__(in_features, out_features, bias, group, sequence_parallel, strategy, dtype, device,
                         weight_shape=(out_local, in_features), bias_shape=(out_local,))
        self._ctx = ctx
        self.fp8 = fp8
        self.save_gathered_input = save_gathered_input
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization with the full layer's fan-in: U(-1/sqrt(in), 1/sqrt(in))."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, weight = self._ctx, self.weight
        if self.fp8 is not None:
            return self._forward_fp8(x)
        if self.sequence_parallel:
            b = weight.t()
            x2d, strategy = self._choose_strategy("ag_gemm", lambda x2d: x2d, b, self.in_features, x)
            if self.save_gathered_input:
                y, _ = torch.ops.tpfuse.ag_gemm(x2d, b, ctx.group_name, strategy)
            else:
                y = _AgGemmRegather.apply(x2d, weight, ctx.group_name, strategy, ctx.world_size)
            lead = (x.shape[0] * ctx.world_size, *x.shape[1:-1])
        else:
            # The collective is the backward's gemm_ar(grad_y [T, out/W], weight [out/W, in]);
            # resolve it from a [T, out/W] view of the input (no data is read).
            x2d, strategy = self._choose_strategy(
                "gemm_ar", lambda x2d: x2d[:, :1].expand(x2d.shape[0], weight.shape[0]), weight,
                self.in_features, x)
            y = _LinearDgradAllReduce.apply(x2d, weight, ctx.group_name, strategy)
            lead = tuple(x.shape[:-1])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, weight.shape[0])

    def _forward_fp8(self, x: torch.Tensor) -> torch.Tensor:
        ctx, weight = self._ctx, self.weight
        if self.sequence_parallel:
            x2d, strategy = self._choose_strategy("ag_gemm", lambda x2d: x2d, weight.t(), self.in_features, x,
                                                  fp8_gemm="forward")
            lead = (x.shape[0] * ctx.world_size, *x.shape[1:-1])
        else:
            # the collective is the backward's gemm_ar(grad_y [T, out/W], weight [out/W, in])
            x2d, strategy = self._choose_strategy(
                "gemm_ar", lambda x2d: x2d[:, :1].expand(x2d.shape[0], weight.shape[0]), weight,
                self.in_features, x, fp8_gemm="grad_input")
            lead = tuple(x.shape[:-1])
        y = _autograd.Fp8ColumnParallel.apply(x2d, weight, ctx.group_name, strategy, ctx.world_size, self.fp8,
                                              self.sequence_parallel, self.save_gathered_input)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, weight.shape[0])

    def extra_repr(self) -> str:
        return super().extra_repr() + f", save_gathered_input={self.save_gathered_input}"


class RowParallelLinear(_ParallelLinear):
    """``y = x @ weight.T + bias`` with the input features split over the group.

    Rank r holds columns ``r*in/W .. (r+1)*in/W`` of the full [out, in] weight; the bias is
    replicated (full on every rank) and added once, after the reduction.  ``T`` is the number of
    tokens (the product of the input's leading dims).

    Forward (``sequence_parallel=True``: ``gemm_rs``; ``False``: ``gemm_ar``):

    | tensor | shape (per rank) | sharding |
    |---|---|---|
    | input ``x`` | [T, in/W] | all tokens, input-feature block r (a column layer's output) |
    | ``weight`` | [out, in/W] | input-feature block r |
    | ``bias`` | [out] | replicated |
    | output ``y`` (SP) | [T/W, out] | token block r of the sum over ranks |
    | output ``y`` (no SP) | [T, out] | the sum over ranks, equal on every rank |

    Backward:

    | gradient | shape (per rank) | how |
    |---|---|---|
    | ``grad_x`` (SP) | [T, in/W] | ``ag_gemm(grad_y, weight)``: all-gather of ``grad_y`` fused with the dgrad GEMM |
    | ``grad_x`` (no SP) | [T, in/W] | ``grad_y @ weight``, local (``grad_y`` is replicated) |
    | ``grad_weight`` | [out, in/W] | ``grad_y_full.T @ x``, local (SP: ``grad_y_full`` is the gathered ``grad_y`` from the dgrad op) |
    | ``grad_bias`` | [out] | SP: ``all_reduce(grad_y.sum(0))``, so every replica gets the full gradient; no SP: ``grad_y.sum(0)`` |

    Leading dims: input ``[d0, *rest, in/W]`` gives ``[d0/W, *rest, out]`` with SP (rank r gets
    block r of dim 0, so ``d0`` must divide by W), ``[d0, *rest, out]`` without.

    Args:
        in_features, out_features: sizes of the full (unsharded) layer; ``in_features`` must
            divide by W.
        bias: learn a (replicated) bias.  It starts at zero, so that replicas start equal
            whatever each rank's random state.
        group, sequence_parallel, strategy, dtype, device: as for :class:`ColumnParallelLinear`;
            here ``sequence_parallel`` means the output is scattered by tokens (dim 0).
        fp8: as for :class:`ColumnParallelLinear`; ``in_features / W`` and ``out_features`` must
            be multiples of 16.
    """

    _weight_shard_dim = 1
    _bias_replicated = True
    _flattened_rows_divisible = True

    @_posts_init_errors
    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 sequence_parallel: bool = True, strategy: str = "auto", dtype: torch.dtype | None = None,
                 device=None, fp8: str | None = None):
        ctx = self._validated_args("RowParallelLinear", in_features, out_features, bias, group,
                                   sequence_parallel, strategy)
        in_local = _check_divisible("RowParallelLinear", "in_features", in_features, ctx.world_size,
                                    "each rank holds in_features / world_size input features")
        fp8 = _check_fp8("RowParallelLinear", fp8, {"in_features / world_size": in_local,
                                                     "out_features": out_features})
        super().__init__(in_features, out_features, bias, group, sequence_parallel, strategy, dtype, device,
                         weight_shape=(out_features, in_local), bias_shape=(out_features,))
        self._ctx = ctx
        self.fp8 = fp8
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Weight U(-1/sqrt(in), 1/sqrt(in)) with the full layer's fan-in; bias zero (replicated)."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, weight = self._ctx, self.weight
        b = weight.t()
        op = "gemm_rs" if self.sequence_parallel else "gemm_ar"
        if self.fp8 is not None and self.sequence_parallel:
            # resolved on the backward's ag_gemm (grad_y shard [T/W, out] x weight [out, in/W]): a
            # strategy that runs it with the recipe's scales runs the forward gemm_rs too, not
            # always the other way round (tpfuse.ops.why_unavailable)
            x2d, strategy = self._choose_strategy(
                "ag_gemm", lambda x2d: x2d[:x2d.shape[0] // ctx.world_size, :1].expand(-1, self.out_features), weight,
                weight.shape[1], x, fp8_gemm="grad_input")
        else:
            x2d, strategy = self._choose_strategy(op, lambda x2d: x2d, b, weight.shape[1], x,
                                                  fp8_gemm="forward" if self.fp8 is not None else None)
        if self.fp8 is not None:
            y = _autograd.Fp8RowParallel.apply(x2d, weight, ctx.group_name, strategy, ctx.world_size, self.fp8,
                                               self.sequence_parallel)
            lead = (x.shape[0] // ctx.world_size, *x.shape[1:-1]) if self.sequence_parallel else tuple(x.shape[:-1])
        elif self.sequence_parallel:
            y = torch.ops.tpfuse.gemm_rs(x2d, b, ctx.group_name, strategy)
            lead = (x.shape[0] // ctx.world_size, *x.shape[1:-1])
        else:
            y = torch.ops.tpfuse.gemm_ar(x2d, b, ctx.group_name, strategy)
            lead = tuple(x.shape[:-1])
        if self.bias is not None:
            bias = self.bias
            if self.sequence_parallel and ctx.world_size > 1:
                bias = _AllReduceGrad.apply(bias, ctx.group_name, ctx.world_size)
            y = y + bias
        return y.reshape(*lead, self.out_features)
