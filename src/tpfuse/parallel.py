"""ParallelStyles for torch's ``parallelize_module`` that compute through the tpfuse ops.

Drop-in replacements for ``torch.distributed.tensor.parallel.ColwiseParallel`` /
``RowwiseParallel`` (and a ``PrepareModuleInput`` that leaves the sequence all-gather to them):

    from torch.distributed.tensor import Shard
    from tpfuse.parallel import ColwiseParallel, RowwiseParallel, PrepareModuleInput, SequenceParallel

    parallelize_module(block, tp_mesh, {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        ...
    })

Parameters are partitioned exactly as torch's styles do (the same code runs): DTensors on the
TP mesh, colwise ``weight``/``bias`` ``Shard(0)``, rowwise ``weight`` ``Shard(1)`` and ``bias``
``Replicate()``, the same state-dict keys.  Optimizers, gradient clipping, DCP and FSDP2 see
nothing different, and checkpoints move between the stock and the tpfuse styles.  Only the
``nn.Linear``'s forward changes: it runs on the local shards through ``torch.ops.tpfuse.*`` with
the TP mesh's process group, and its backward through the ops' registered autograd formulas.

| module | input (per rank) | output (per rank) | forward | backward |
|---|---|---|---|---|
| colwise, SP | ``Shard(d)``: [.., S/W, .., K] | [.., S, .., N/W] | ``ag_gemm`` | dgrad ``gemm_rs``; wgrad from the gathered input |
| colwise, no SP | ``Replicate``: [.., S, .., K] | [.., S, .., N/W] | local GEMM | local GEMM; input grad ``Partial`` (reduced upstream, as torch does) |
| rowwise, SP | [.., S, .., K/W] | ``Shard(d)``: [.., S/W, .., N] | ``gemm_rs`` | dgrad + wgrad from ``ag_gemm`` |
| rowwise, no SP | [.., S, .., K/W] | ``Replicate``: [.., S, .., N] | ``gemm_ar`` | local GEMMs |

``d`` is any dim but the last (the sequence dim 1 of [batch, seq, hidden] in torchtitan, dim 0
of Megatron's [seq, batch, hidden]).  The ops shard rows of the flattened [tokens, features]
matrix, rank-major; when the dims before ``d`` hold more than one element (batch > 1 with
``Shard(1)``), the colwise output and the rowwise input are permuted between the op's rank-major
row order and the tensor's order (one copy of that activation); with batch 1 or ``Shard(0)``
nothing is copied.  docs/parallel.md has the details.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor import parallel as _tp
from torch.distributed.tensor.placement_types import Placement

from tpfuse import _checks, _fp8, strategies
from tpfuse import autograd as _autograd  # also registers the custom ops' autograd formulas
from tpfuse._dist import GroupContext, group_context
from tpfuse.nn import _AllReduceGrad, _fp8_stand_in
from tpfuse.ops import resolve_strategy, traced_strategy

__all__ = ["ColwiseParallel", "RowwiseParallel", "PrepareModuleInput", "SequenceParallel", "parallelize_module"]

# Re-exported unchanged: norms under sequence parallelism run on the local shard (torch's style
# fits), and parallelize_module is torch's own.
SequenceParallel = _tp.SequenceParallel
parallelize_module = _tp.parallelize_module


# --------------------------------------------------------------------------------------------
# Argument checks (construction time: the same on every rank, before any communication)
# --------------------------------------------------------------------------------------------


def _check_strategy(style: str, strategy: object) -> str:
    if not isinstance(strategy, str):
        raise TypeError(f"{style}: strategy must be a string, got {type(strategy).__name__} ({strategy!r})")
    if strategy != "auto" and strategy not in strategies.names():
        raise ValueError(f"{style}: unknown strategy {strategy!r}; choose one of "
                         f"{', '.join(strategies.names())} or 'auto'")
    return strategy


def _check_fp8(style: str, fp8: object) -> None:
    if fp8 is not None and fp8 not in _fp8.RECIPES:
        raise ValueError(f"{style}: fp8={fp8!r} is not a recipe; use None or one of "
                         f"{', '.join(map(repr, _fp8.RECIPES))} (docs/nn.md, fp8)")


def _check_placement(style: str, name: str, value: object, allowed: tuple[type, ...]) -> None:
    if value is not None and not isinstance(value, allowed):
        names = " or ".join(t.__name__ + "()" for t in allowed)
        raise TypeError(f"{style}: {name} must be a Placement ({names}) or None, got {value!r}")


def _check_mesh(style: str, device_mesh: object) -> DeviceMesh:
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{style}: the device mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.ndim != 1:
        raise ValueError(
            f"{style}: parallelize_module got a {device_mesh.ndim}-D mesh {device_mesh.mesh_dim_names}; "
            f"tensor parallelism runs on one mesh dim: pass the TP sub-mesh (mesh['tp'])"
        )
    return device_mesh


def _dim(placement: Shard, ndim: int) -> int:
    return placement.dim % ndim if ndim else placement.dim


# --------------------------------------------------------------------------------------------
# Local math
# --------------------------------------------------------------------------------------------


def _concrete_strategy(label: str, op: str, strategy: str, a: torch.Tensor, b: torch.Tensor,
                       ctx: GroupContext, fp8: str | None = None, gemm: str = "forward") -> str:
    """The strategy ``torch.ops.tpfuse.<op>(a, b)`` runs, as :mod:`tpfuse.nn` chooses it: fixed at
    trace time under ``torch.compile``; in eager, with the agreement round on (CPU tensors on
    gloo, or ``TPFUSE_DEBUG=1``), a bad call on any rank raises on every rank.  ``fp8``: the
    recipe; the strategy is then resolved for the scaled op, with fp8 stand-ins of the operands
    and scales that the recipe's ``gemm`` casts (as the tpfuse.nn fp8 layers do)."""
    scaled: dict = {}
    if fp8 is not None:
        (ga, da), (gb, db) = _fp8.RECIPES[fp8][gemm]
        dev, out_dtype = a.device, a.dtype
        scaled = dict(scale_a=_fp8_stand_in((a.shape[0], 1) if ga == "rows" else (), torch.float32, dev),
                      scale_b=_fp8_stand_in((1, b.shape[1]) if gb == "rows" else (), torch.float32, dev),
                      out_dtype=out_dtype)
        a, b = _fp8_stand_in(tuple(a.shape), da, dev), _fp8_stand_in(tuple(b.shape), db, dev)
    if torch.compiler.is_compiling():
        return traced_strategy(op, strategy, a, b, ctx, **scaled)
    if not _checks.agreement_enabled(ctx, a.device.type):
        return resolve_strategy(op, strategy, a, b, ctx, **scaled)
    error, chosen, signature = None, "unfused", None
    try:
        _checks.check_call(op, a, b, ctx, strategy, **scaled)
        chosen = resolve_strategy(op, strategy, a, b, ctx, **scaled)
        signature = _checks.signature(op, chosen, a, b, 0, **scaled)
    except (TypeError, ValueError) as exc:
        error = exc
    _checks.agree(ctx, label, error, signature)
    return chosen


def _check_local_input(label: str, x: torch.Tensor, weight: torch.Tensor, features: int, what: str) -> None:
    if x.dim() < 2:
        raise ValueError(f"{label}: input of shape {tuple(x.shape)} needs at least 2 dims ([tokens, features])")
    if x.shape[-1] != features:
        raise ValueError(f"{label}: this rank's input has {x.shape[-1]} features (shape {tuple(x.shape)}) "
                         f"but the layer takes {features} ({what})")
    if x.dtype != weight.dtype:
        raise TypeError(f"{label}: input is {x.dtype} but the weight is {weight.dtype}; cast one of them")


def _check_divisible(label: str, what: str, size: int, world_size: int) -> None:
    if size % world_size:
        raise ValueError(
            f"{label}: {what} = {size} must be divisible by the TP world size {world_size} (the fused "
            f"ops shard tokens evenly); pad it to {-(-size // world_size) * world_size}"
        )


def _ag_linear(label: str, x_shard: torch.Tensor, weight: torch.Tensor, dim: int, strategy: str,
               ctx: GroupContext, fp8: str | None = None) -> torch.Tensor:
    """``all_gather(x_shard, dim) @ weight.T`` through ``ag_gemm``: [.., S/W, .., K] -> [.., S, .., N]
    (``fp8``: the recipe's casts, through the fp8 column layer's autograd Function)."""
    world_size, k, n = ctx.world_size, x_shard.shape[-1], weight.shape[0]
    a, b = x_shard.reshape(-1, k), weight.t()
    chosen = _concrete_strategy(label, "ag_gemm", strategy, a, b, ctx, fp8)
    if fp8 is not None:
        c = _autograd.Fp8ColumnParallel.apply(a, weight, ctx.group_name, chosen, world_size, fp8, True, True)
    else:
        c, _ = torch.ops.tpfuse.ag_gemm(a, b, ctx.group_name, chosen)  # rows (rank, *pre, s, *post)
    shape = list(x_shard.shape[:-1]) + [n]
    shape[dim] *= world_size
    pre = x_shard.shape[:dim].numel()
    if pre > 1:  # the tensor's order is (*pre, rank, s, *post): move the rank behind the leading dims
        c = c.view(world_size, pre, -1).transpose(0, 1)
    return c.reshape(shape)


def _linear_rs(label: str, x: torch.Tensor, weight: torch.Tensor, dim: int, strategy: str,
               ctx: GroupContext, fp8: str | None = None) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T, dim)`` through ``gemm_rs``: [.., S, .., K] -> [.., S/W, .., N]."""
    world_size, k = ctx.world_size, x.shape[-1]
    pre = x.shape[:dim].numel()
    if pre > 1:  # the op scatters rank-major row blocks: put rank r's tokens (*pre, block r, *post) together
        a = x.reshape(pre, world_size, -1, k).transpose(0, 1).reshape(-1, k)
    else:
        a = x.reshape(-1, k)
    b = weight.t()
    chosen = _concrete_strategy(label, "gemm_rs", strategy, a, b, ctx, fp8)
    if fp8 is not None:
        c_shard = _autograd.Fp8RowParallel.apply(a, weight, ctx.group_name, chosen, world_size, fp8, True)
    else:
        c_shard = torch.ops.tpfuse.gemm_rs(a, b, ctx.group_name, chosen)
    shape = list(x.shape[:-1]) + [weight.shape[0]]
    shape[dim] //= world_size
    return c_shard.reshape(shape)


def _linear_ar(label: str, x: torch.Tensor, weight: torch.Tensor, strategy: str, ctx: GroupContext,
               fp8: str | None = None) -> torch.Tensor:
    """``all_reduce(x @ weight.T)`` through ``gemm_ar``: [.., K] -> [.., N]."""
    a, b = x.reshape(-1, x.shape[-1]), weight.t()
    chosen = _concrete_strategy(label, "gemm_ar", strategy, a, b, ctx, fp8)
    if fp8 is not None:
        c = _autograd.Fp8RowParallel.apply(a, weight, ctx.group_name, chosen, ctx.world_size, fp8, False)
    else:
        c = torch.ops.tpfuse.gemm_ar(a, b, ctx.group_name, chosen)
    return c.reshape(*x.shape[:-1], weight.shape[0])


# --------------------------------------------------------------------------------------------
# The styles
# --------------------------------------------------------------------------------------------


class _TpfuseLinear:
    """Mixin put in front of a parallelized ``nn.Linear``'s class: its forward asks the style."""

    _tpfuse_style: "_LinearStyle"
    _tpfuse_mesh: DeviceMesh
    _tpfuse_ctx: GroupContext

    def forward(self, input: torch.Tensor):  # noqa: A002  (nn.Linear's argument name)
        return self._tpfuse_style._forward(self, input)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", tpfuse={self._tpfuse_style!r}"


_LINEAR_CLASSES: dict[type, type] = {}


def _tpfuse_class(cls: type) -> type:
    """``cls`` with :class:`_TpfuseLinear` in front (one class per original class, as FSDP2 does)."""
    new = _LINEAR_CLASSES.get(cls)
    if new is None:
        new = type(cls.__name__, (_TpfuseLinear, cls), {"__module__": cls.__module__})
        _LINEAR_CLASSES[cls] = new
    return new


class _LinearStyle:
    """What ColwiseParallel and RowwiseParallel share (mixed in front of torch's style)."""

    strategy: str
    output_layouts: tuple[Placement, ...]
    use_local_output: bool

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, strategy: str = "auto", fp8=None):
        style = type(self).__name__
        _check_placement(style, "input_layouts", input_layouts, (Shard, Replicate, Partial))
        _check_placement(style, "output_layouts", output_layouts, (Shard, Replicate))
        self.strategy = _check_strategy(style, strategy)
        _check_fp8(style, fp8)
        self.fp8 = fp8
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = type(self).__name__
        if isinstance(module, nn.Embedding):  # no GEMM to fuse: torch's style as is
            return super()._apply(module, device_mesh)
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"tpfuse {style} supports nn.Linear (and nn.Embedding through torch's "
                                      f"style), got {type(module).__name__}")
        _check_mesh(style, device_mesh)
        self._partition_linear_fn("", module, device_mesh)  # torch's own partitioning: same DTensors
        module._tpfuse_style = self
        module._tpfuse_mesh = device_mesh
        module._tpfuse_ctx = group_context(device_mesh.get_group())
        module.__class__ = _tpfuse_class(type(module))
        return module

    def _finish(self, module, y: torch.Tensor, placement: Placement):
        """``y`` (this rank's part of the output, laid out as ``placement``) in ``output_layouts``."""
        wanted = self.output_layouts[0]
        if isinstance(wanted, Shard):
            wanted = Shard(_dim(wanted, y.dim()))
        if wanted == placement and self.use_local_output:
            return y
        out = DTensor.from_local(y, module._tpfuse_mesh, [placement], run_check=False)
        if wanted != placement:
            out = out.redistribute(placements=[wanted])
        return out.to_local() if self.use_local_output else out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(input_layouts={self.input_layouts}, output_layouts={self.output_layouts}, "
                f"use_local_output={self.use_local_output}, strategy={self.strategy!r})")


class ColwiseParallel(_LinearStyle, _tp.ColwiseParallel):
    """torch's ``ColwiseParallel`` whose ``nn.Linear`` computes through ``ag_gemm``.

    Parameters: ``weight`` [N, K] -> ``Shard(0)`` ([N/W, K] per rank), ``bias`` -> ``Shard(0)``.
    The output is the local [.., N/W] block (``Shard(-1)``), redistributed to ``output_layouts``.

    | input | forward | grad of the input | grad of weight, bias |
    |---|---|---|---|
    | ``Shard(d)``, ``d`` not last (SP) | ``ag_gemm``: gather fused with the GEMM | ``gemm_rs(grad_y, weight)`` | ``grad_y.T @ x_gathered``, ``grad_y.sum`` (local) |
    | ``Replicate`` | local GEMM | ``grad_y @ weight`` as ``Partial``: reduced once where the input came from, as torch does | local |
    | other (``Shard(-1)``, ``Partial``) | redistributed to ``Replicate`` first (DTensor), as torch does | | |

    A plain-tensor input is taken as ``input_layouts``; a DTensor input as its own placement
    (pair with :class:`PrepareModuleInput` so that a sequence-sharded activation reaches the layer
    ungathered).  Shard(d) needs the global size of ``d`` divisible by W.

    Keyword Args:
        input_layouts, output_layouts, use_local_output: as torch's ``ColwiseParallel``.
        strategy: the tpfuse strategy ("auto", "unfused", "ring", "copy_engine", "fused", ...).
        fp8: None, or an fp8 recipe of the tpfuse.nn layers ("tensorwise", "rowwise"): the fused
            GEMMs (and the input-gradient GEMM) run in fp8 with dynamic scaling, the weight
            gradient in the parameters' dtype (docs/nn.md, fp8).
    """

    def _local_input(self, module, x) -> tuple[torch.Tensor, Placement]:
        """This rank's input and its layout: a ``Shard(d)`` shard (d not last) or a ``Replicate`` copy."""
        mesh, label = module._tpfuse_mesh, f"ColwiseParallel({type(module).__name__})"
        if isinstance(x, DTensor):
            if x.device_mesh != mesh:
                raise ValueError(f"{label}: the input DTensor lives on {x.device_mesh}, the layer on {mesh}")
            placement = x.placements[0]
            global_shape = x.shape
        else:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{label}: input must be a torch.Tensor or DTensor, got {type(x).__name__}")
            placement = self.input_layouts[0]
            global_shape = None
        if isinstance(placement, Shard) and _dim(placement, x.dim()) < x.dim() - 1:
            dim = _dim(placement, x.dim())
            if global_shape is not None:
                _check_divisible(label, f"the input's dim {dim} (shape {tuple(global_shape)})",
                                 global_shape[dim], module._tpfuse_ctx.world_size)
                x = x.to_local()
            return x, Shard(dim)
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [placement], run_check=False)
        if not isinstance(placement, Replicate):
            x = x.redistribute(placements=[Replicate()])
        # Each rank's input gradient is a partial sum (its N/W output features): left Partial, it
        # is reduced once where the input came from (for q, k and v together), as torch's style does.
        return x.to_local(grad_placements=[Partial()]), Replicate()

    def _forward(self, module, x):
        ctx, label = module._tpfuse_ctx, f"ColwiseParallel({type(module).__name__})"
        x_local, placement = self._local_input(module, x)
        weight = module.weight.to_local()
        _check_local_input(label, x_local, weight, weight.shape[1], "in_features")
        if isinstance(placement, Shard):
            y = _ag_linear(label, x_local, weight, placement.dim, self.strategy, ctx, self.fp8)
        elif self.fp8 is not None:
            raise NotImplementedError(
                f"{label}: fp8={self.fp8!r} runs on the fused paths (a sequence-sharded input: Shard(d) "
                f"with d not the last dim); this input is Replicate, a local GEMM; pass fp8=None here")
        else:
            y = torch.matmul(x_local, weight.t())
        if module.bias is not None:
            y = y + module.bias.to_local()
        return self._finish(module, y, Shard(y.dim() - 1))


class RowwiseParallel(_LinearStyle, _tp.RowwiseParallel):
    """torch's ``RowwiseParallel`` whose ``nn.Linear`` computes through ``gemm_rs`` / ``gemm_ar``.

    Parameters: ``weight`` [N, K] -> ``Shard(1)`` ([N, K/W] per rank), ``bias`` -> ``Replicate()``.
    The input is the local [.., K/W] block (``Shard(-1)``; other layouts are redistributed to it
    first, as torch does).

    | ``output_layouts`` | forward | grad of the input and weight | grad of bias |
    |---|---|---|---|
    | ``Shard(d)``, ``d`` not last (SP) | ``gemm_rs``: reduce-scatter fused with the GEMM | ``ag_gemm(grad_y, weight)``; wgrad from its gathered ``grad_y`` | ``all_reduce(grad_y.sum)`` (every replica gets the full gradient) |
    | ``Replicate()`` (default) | ``gemm_ar``: all-reduce fused with the GEMM | local GEMMs (``grad_y`` is replicated) | ``grad_y.sum``, local |
    | other ``Shard`` | ``gemm_ar``, then sliced (DTensor) | | |

    ``Partial()`` outputs are not supported.  Shard(d) needs the size of ``d`` divisible by W.

    Keyword Args:
        input_layouts, output_layouts, use_local_output: as torch's ``RowwiseParallel``.
        strategy: the tpfuse strategy ("auto", "unfused", "ring", "copy_engine", "fused", ...).
        fp8: None, or an fp8 recipe of the tpfuse.nn layers ("tensorwise", "rowwise"): the fused
            GEMMs (and the input-gradient GEMM) run in fp8 with dynamic scaling, the weight
            gradient in the parameters' dtype (docs/nn.md, fp8).
    """

    def _local_input(self, module, x) -> torch.Tensor:
        mesh, label = module._tpfuse_mesh, f"RowwiseParallel({type(module).__name__})"
        if isinstance(x, DTensor):
            if x.device_mesh != mesh:
                raise ValueError(f"{label}: the input DTensor lives on {x.device_mesh}, the layer on {mesh}")
            placement = x.placements[0]
        else:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{label}: input must be a torch.Tensor or DTensor, got {type(x).__name__}")
            placement = self.input_layouts[0]
        last = Shard(x.dim() - 1)
        if isinstance(placement, Shard) and _dim(placement, x.dim()) == x.dim() - 1:
            return x.to_local() if isinstance(x, DTensor) else x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [placement], run_check=False)
        return x.redistribute(placements=[last]).to_local()

    def _forward(self, module, x):
        ctx, label = module._tpfuse_ctx, f"RowwiseParallel({type(module).__name__})"
        x_local = self._local_input(module, x)
        weight = module.weight.to_local()
        _check_local_input(label, x_local, weight, weight.shape[1], "in_features / world_size")
        wanted = self.output_layouts[0]
        bias = module.bias.to_local() if module.bias is not None else None
        if isinstance(wanted, Shard) and _dim(wanted, x_local.dim()) < x_local.dim() - 1:
            dim = _dim(wanted, x_local.dim())
            _check_divisible(label, f"the output's dim {dim} (input shape {tuple(x_local.shape)})",
                             x_local.shape[dim], ctx.world_size)
            y = _linear_rs(label, x_local, weight, dim, self.strategy, ctx, self.fp8)
            placement = Shard(dim)
            if bias is not None and ctx.world_size > 1:
                # replicated, but added to this rank's tokens only: sum its gradient over the group
                bias = _AllReduceGrad.apply(bias, ctx.group_name, ctx.world_size)
        else:
            y = _linear_ar(label, x_local, weight, self.strategy, ctx, self.fp8)
            placement = Replicate()
        if bias is not None:
            y = y + bias
        return self._finish(module, y, placement)


class PrepareModuleInput(_tp.PrepareModuleInput):
    """torch's ``PrepareModuleInput``, except that a sequence-sharded input stays sharded.

    Where an input is ``Shard(d)`` (``d`` not last) and its desired layout is ``Replicate()``, the
    module gets the ``Shard(d)`` DTensor instead of an all-gathered one: the same global tensor
    (``x.shape`` is the full shape), so DTensor code inside the module computes the same result,
    and the tpfuse :class:`ColwiseParallel` layers that consume it gather it fused with their GEMM
    (``ag_gemm``) instead of waiting for a separate all-gather.  Everything else is torch's.

    With ``use_local_output=True`` the module would see the local shard instead of the whole
    tensor, so that combination raises ``ValueError``; use torch's style there.
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False):
        super().__init__(input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
                         input_kwarg_layouts=input_kwarg_layouts,
                         desired_input_kwarg_layouts=desired_input_kwarg_layouts, use_local_output=use_local_output)
        deferred = False
        if self.input_layouts is not None:
            self.desired_input_layouts, deferred = self._defer(self.input_layouts, self.desired_input_layouts)
        if self.input_kwarg_layouts:
            keys = list(self.input_kwarg_layouts)
            desired, kw_deferred = self._defer(tuple(self.input_kwarg_layouts[k] for k in keys),
                                               tuple(self.desired_input_kwarg_layouts.get(k) for k in keys))
            self.desired_input_kwarg_layouts = dict(zip(keys, desired))
            deferred = deferred or kw_deferred
        if deferred and use_local_output:
            raise ValueError(
                "PrepareModuleInput: use_local_output=True with a sequence-sharded input whose desired "
                "layout is Replicate() would hand the module a local shard; pass use_local_output=False "
                "(the module then gets a Shard DTensor of the full shape) or use torch's PrepareModuleInput"
            )

    @staticmethod
    def _defer(inputs, desired) -> tuple[tuple, bool]:
        out, deferred = [], False
        for have, want in zip(inputs, desired):
            if isinstance(have, Shard) and have.dim != -1 and isinstance(want, Replicate):
                out.append(have)
                deferred = True
            else:
                out.append(want)
        return tuple(out), deferred
