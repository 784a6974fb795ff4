"""fp8 (scaled) ops and layers on W gloo ranks, against float64 references of the dequantized inputs.

Every case runs on CPU ranks (``torch._scaled_mm`` runs on CPU in torch 2.13), many cases per
spawn.  Outputs are poisoned with NaN (TPFUSE_POISON=1 in the pools), so an unwritten element
fails.

Tolerance of the ops (derived, elementwise).  The reference multiplies the dequantized inputs
``a8 * scale_a`` and ``b8 * scale_b`` in float64, which is exact for the products.  The op
dequantizes (one float32 rounding per product of an fp8 value and a float32 scale), multiplies
and accumulates in float32 (at most K + W further roundings along any sum, with the cross-rank
float32 reduction) and rounds once to ``out_dtype``.  With ``u32 = 2**-24`` and ``u_out`` the unit
roundoff of ``out_dtype`` (bf16: 2**-8, fp32: 2**-24), the standard bound is

    |c - ref| <= g + u_out * (|ref| + g),   g = (K_total + W + 4) * u32 * (|A| @ |B|)

where ``|A| @ |B|`` multiplies the magnitudes of the dequantized operands (sum over ranks).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse import _fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT = {"bf16": torch.bfloat16, "fp32": torch.float32}
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
M_SHARD, K, N = 5, 48, 32  # M/W odd; K and N multiples of 16 (the fp8 rule)


def _quantize(x: torch.Tensor, granularity: str, dtype=E4M3):
    """(x8, scale) with the library's dynamic scaling; granularity "tensor" or "rows"."""
    return _fp8.quantize(x, dtype, granularity)


def _weight(g, rows: int, cols: int, granularity: str, dtype=E4M3):
    """An fp8 [N, K] weight; b = weight.t() (column-major, as the layers pass it) and its scale
    ([1, N] row-wise: one per output channel)."""
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    w8, sw = _quantize(w, granularity, dtype)
    return w8.t(), (sw.reshape(()) if granularity == "tensor" else sw.reshape(1, rows))


def _deq(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x8.double() * scale.double()


def _bound(mag: torch.Tensor, ref: torch.Tensor, k_total: int, world_size: int,
           out_dtype: torch.dtype) -> torch.Tensor:
    """The module docstring's bound; ``mag`` = |A| @ |B| of the dequantized operands."""
    g = (k_total + world_size + 4) * 2.0 ** -24 * mag
    return g + UNIT[out_dtype] * (ref.abs() + g)


def _problem(op: str, rank: int, world_size: int, granularity: str, seed: int, mixed: bool):
    """This rank's fp8 operands and scales, plus the float64 reference output and its bound's
    magnitude product, identical math on every rank (built from one seed)."""
    g = torch.Generator().manual_seed(seed)
    a_dtype = E5M2 if mixed else E4M3  # mixed: a gradient in e5m2 times an e4m3 weight
    if op == "ag_gemm":
        a = torch.randn(world_size * M_SHARD, K, generator=g, dtype=torch.float64) * 3
        if granularity == "tensor":  # one scale for the whole gathered A (same on every rank)
            a8_full, sa_full = _quantize(a, "tensor", a_dtype)
        else:
            a8_full, sa_full = _quantize(a, "rows", a_dtype)
        b8, sb = _weight(g, N + 16 * rank, K, granularity)  # N differs per rank (ag_gemm allows it)
        rows = slice(rank * M_SHARD, (rank + 1) * M_SHARD)
        sa = sa_full if granularity == "tensor" else sa_full[rows]
        ref = _deq(a8_full, sa_full) @ _deq(b8, sb)
        mag = _deq(a8_full, sa_full).abs() @ _deq(b8, sb).abs()
        return dict(a=a8_full[rows].contiguous(), b=b8, scale_a=sa, scale_b=sb, a8_full=a8_full,
                    sa_full=sa_full, ref=ref, mag=mag, k_total=K)
    # gemm_rs / gemm_ar: rank r holds K columns of A (its own scales) and the matching rows of B
    m = world_size * M_SHARD
    ref = torch.zeros(m, N, dtype=torch.float64)
    mag = torch.zeros(m, N, dtype=torch.float64)
    mine = None
    for r in range(world_size):
        a_r = torch.randn(m, K, generator=g, dtype=torch.float64) * (1 + r)
        a8, sa = _quantize(a_r, granularity, a_dtype)
        b8, sb = _weight(g, N, K, granularity)
        ref += _deq(a8, sa) @ _deq(b8, sb)
        mag += _deq(a8, sa).abs() @ _deq(b8, sb).abs()
        if r == rank:
            mine = dict(a=a8, b=b8, scale_a=sa, scale_b=sb)
    if op == "gemm_rs":
        rows = slice(rank * M_SHARD, (rank + 1) * M_SHARD)
        ref, mag = ref[rows], mag[rows]
    return dict(mine, ref=ref, mag=mag, k_total=world_size * K)


def op_cases(rank, world_size, cases, iters=2):
    """For each (op, strategy, granularity, out, mixed): worst error / bound ratio, and the
    exactness of the gathered A and scales (ag_gemm), over ``iters`` calls in a row."""
    report = []
    for index, (op, strategy, granularity, out_name, mixed) in enumerate(cases):
        out_dtype = OUT[out_name]
        p = _problem(op, rank, world_size, granularity, seed=10 + index, mixed=mixed)
        row = dict(case=(op, strategy, granularity, out_name, mixed), ratio=0.0, ok=True, why=[])
        for _ in range(iters):
            kw = dict(scale_a=p["scale_a"], scale_b=p["scale_b"], out_dtype=out_dtype, strategy=strategy)
            if op == "ag_gemm":
                c, a_full, scale_full = tpfuse.ag_gemm(p["a"], p["b"], return_gathered=True, **kw)
                if not torch.equal(a_full.view(torch.uint8), p["a8_full"].view(torch.uint8)):
                    row["ok"] = False
                    row["why"].append("a_full differs")
                if not torch.equal(scale_full, p["sa_full"]):
                    row["ok"] = False
                    row["why"].append("scale_a_full differs")
            else:
                c = getattr(tpfuse, op)(p["a"], p["b"], **kw)
            if c.dtype != out_dtype or tuple(c.shape) != tuple(p["ref"].shape) or not torch.isfinite(c).all():
                row["ok"] = False
                row["why"].append(f"dtype {c.dtype} shape {tuple(c.shape)} finite {bool(torch.isfinite(c).all())}")
                continue
            bound = _bound(p["mag"], p["ref"], p["k_total"], world_size, out_dtype)
            ratio = ((c.double() - p["ref"]).abs() / bound).max().item()
            row["ratio"] = max(row["ratio"], ratio)
        report.append(row)
    return report


CASES = [(op, strategy, granularity, out_name, False)
         for op in ("ag_gemm", "gemm_rs", "gemm_ar")
         for strategy in ("unfused", "ring", "auto")
         for granularity in ("tensor", "rows")
         for out_name in ("bf16", "fp32")]
# e5m2 x e4m3 (the gradient mix) on a few cases
CASES += [(op, "ring", "tensor", "bf16", True) for op in ("ag_gemm", "gemm_rs", "gemm_ar")]


@pytest.mark.parametrize("world_size, iters", [(2, 2), (3, 1)])  # W = 2: two calls in a row
def test_ops_match_float64_reference(rank_pool, world_size, iters):
    reports = rank_pool(world_size).run(op_cases, CASES, iters=iters, timeout=240)
    for rank, report in enumerate(reports):
        for row in report:
            assert row["ok"], f"rank {rank} {row['case']}: {row['why']}"
            assert row["ratio"] <= 1.0, f"rank {rank} {row['case']}: error {row['ratio']:.2f} x the derived bound"
    # the bound is not vacuous: bf16 outputs use a good part of it
    worst_bf16 = max(row["ratio"] for report in reports for row in report if row["case"][3] == "bf16")
    assert worst_bf16 > 0.05


# ---------------------------------------------------------------------------------------------
# Bad input: every rank raises before any communication (one bad rank included)
# ---------------------------------------------------------------------------------------------


def _bad_call(case: str, rank: int, world_size: int):
    last = rank == world_size - 1
    a8 = torch.randn(4, 32).to(E4M3)
    b8 = torch.randn(16, 32).to(E4M3).t()  # [32, 16]
    one = torch.tensor(1.0)
    rows = torch.ones(4, 1)
    cols = torch.ones(1, 16)
    a_rs = torch.randn(4 * world_size, 32).to(E4M3)
    if case == "fp8_with_bf16":
        return lambda: tpfuse.ag_gemm(a8, b8.bfloat16(), scale_a=one, scale_b=one)
    if case == "missing_scale_b":
        return lambda: tpfuse.gemm_ar(a8, b8, scale_a=one)
    if case == "scale_a_wrong_shape":
        return lambda: tpfuse.ag_gemm(a8, b8, scale_a=torch.ones(3, 1), scale_b=one)
    if case == "scale_b_wrong_shape":
        return lambda: tpfuse.gemm_ar(a8, b8, scale_a=rows, scale_b=torch.ones(16, 1))
    if case == "scale_float64":
        return lambda: tpfuse.gemm_ar(a8, b8, scale_a=one.double(), scale_b=one)
    if case == "scale_on_bf16":
        return lambda: tpfuse.gemm_ar(torch.randn(4, 32), torch.randn(32, 16), scale_a=one)
    if case == "out_dtype_on_bf16":
        return lambda: tpfuse.gemm_ar(torch.randn(4, 32), torch.randn(32, 16), out_dtype=torch.float32)
    if case == "fp8_out_dtype":
        return lambda: tpfuse.gemm_ar(a8, b8, scale_a=one, scale_b=one, out_dtype=E4M3)
    if case == "e5m2_both":
        return lambda: tpfuse.gemm_ar(a8.float().to(E5M2), b8.float().to(E5M2), scale_a=one, scale_b=one)
    if case == "k_not_16":
        return lambda: tpfuse.gemm_ar(a8[:, :24], b8[:24], scale_a=one, scale_b=one)
    if case == "n_not_16":
        return lambda: tpfuse.ag_gemm(a8, b8[:, :8], scale_a=one, scale_b=one)
    if case == "sm_workers_fp8":   # its policy entry refuses fp8 (copy_engine and fused take it)
        return lambda: tpfuse.gemm_rs(a_rs, b8, scale_a=one, scale_b=cols, strategy="sm_workers")
    if case == "one_rank_bad_scale":  # only the last rank's row-wise scale_a has a wrong shape
        return lambda: tpfuse.gemm_rs(a_rs, b8, scale_a=torch.ones(4 * world_size + (1 if last else 0), 1),
                                      scale_b=cols, strategy="ring")
    if case == "one_rank_bad_scale_dtype":  # only the last rank's scale is bfloat16
        return lambda: tpfuse.ag_gemm(a8, b8, scale_a=one.bfloat16() if last else one, scale_b=one)
    if case == "ranks_disagree_on_granularity":  # each valid, but rank 0 is tensor-wise
        return lambda: tpfuse.ag_gemm(a8, b8, scale_a=one if rank == 0 else rows, scale_b=one, strategy="unfused")
    if case == "layer_unknown_recipe":
        return lambda: tpfuse.nn.ColumnParallelLinear(32, 32 * world_size, fp8="e4m3")
    if case == "layer_size_not_16":
        return lambda: tpfuse.nn.RowParallelLinear(24 * world_size, 32, fp8="rowwise")
    raise AssertionError(case)


BAD_CASES = {
    "fp8_with_bf16": (TypeError, "quantize"), "missing_scale_b": (ValueError, "scale_b is required"),
    "scale_a_wrong_shape": (ValueError, "[4, 1]"), "scale_b_wrong_shape": (ValueError, "[1, 16]"),
    "scale_float64": (TypeError, "float32"), "scale_on_bf16": (ValueError, "scale_a is for fp8"),
    "out_dtype_on_bf16": (ValueError, "out_dtype is for fp8"), "fp8_out_dtype": (TypeError, "out_dtype"),
    "e5m2_both": (TypeError, "float8_e5m2"), "k_not_16": (ValueError, "multiples of 16"),
    "n_not_16": (ValueError, "multiples of 16"), "sm_workers_fp8": (ValueError, "sm_workers does not run fp8"),
    "one_rank_bad_scale": (ValueError, "invalid input on rank(s)"),
    "one_rank_bad_scale_dtype": (ValueError, "invalid input on rank(s)"),
    "ranks_disagree_on_granularity": (ValueError, "scale_a"),
    "layer_unknown_recipe": (ValueError, "'tensorwise' or 'rowwise'"),
    "layer_size_not_16": (ValueError, "in_features / world_size = 24"),
}
OWN_MESSAGE = {"one_rank_bad_scale": (ValueError, "scale_a has shape"),
               "one_rank_bad_scale_dtype": (TypeError, "float32")}


def bad_cases(rank, world_size, cases):
    from tests.conftest import caught_then_probe

    return {case: caught_then_probe(rank, _bad_call(case, rank, world_size)) for case in cases}


def test_bad_input_raises_on_every_rank(rank_pool):
    world_size = 2
    results = rank_pool(world_size).run(bad_cases, sorted(BAD_CASES), timeout=120)
    for rank, by_case in enumerate(results):
        for case, (caught, probe) in by_case.items():
            expected_type, expected_text = BAD_CASES[case]
            if case in OWN_MESSAGE and rank == world_size - 1:
                expected_type, expected_text = OWN_MESSAGE[case]  # the bad rank gets its own message
            assert caught is not None, f"rank {rank}: no error for {case}"
            assert caught[0] == expected_type.__name__, f"rank {rank} {case}: {caught}"
            assert expected_text in caught[1], f"rank {rank} {case}: {caught[1]!r} should mention {expected_text!r}"
            assert probe == sum(range(world_size)), f"rank {rank} {case}: the group is unusable after the error"


# ---------------------------------------------------------------------------------------------
# Custom ops: fake implementations give the out_dtype and the gathered scales' shapes
# ---------------------------------------------------------------------------------------------


def fake_shapes(rank, world_size):
    from torch._subclasses.fake_tensor import FakeTensorMode

    name = dist.group.WORLD.group_name
    with FakeTensorMode():
        a, b = torch.empty(5, 32, dtype=E4M3), torch.empty(32, 16, dtype=E4M3)
        c, a_full, s_full = torch.ops.tpfuse.ag_gemm_scaled(a, b, name, "ring", torch.empty(5, 1),
                                                            torch.empty(1, 16), torch.float32)
        rs = torch.ops.tpfuse.gemm_rs_scaled(torch.empty(5 * world_size, 32, dtype=E4M3), b, name, "ring",
                                             torch.empty(()), torch.empty(()), torch.bfloat16)
        ar = torch.ops.tpfuse.gemm_ar_scaled(a, b, name, "unfused", torch.empty(()), torch.empty(()), torch.float16)
    return [(tuple(t.shape), str(t.dtype)) for t in (c, a_full, s_full, rs, ar)]


def test_fake_impls(rank_pool):
    for shapes in rank_pool(2).run(fake_shapes):
        assert shapes == [((10, 16), "torch.float32"), ((10, 32), "torch.float8_e4m3fn"), ((10, 1), "torch.float32"),
                          ((5, 16), "torch.bfloat16"), ((5, 16), "torch.float16")]


# ---------------------------------------------------------------------------------------------
# Layers: forward and both gradients against the unsharded layer in the same recipe (float64)
# ---------------------------------------------------------------------------------------------
#
# Every rank builds the full float64 layer, input and output gradient from one seed, rounded to
# the parameter dtype.  The reference quantizes them exactly as the recipe says for the
# unsharded layer (amax over whole tensors, token rows, output channels), so its fp8 operands
# are the layers' fp8 operands bit for bit when the layers' all-reduced amaxes are right, and it
# multiplies in float64.  The layers' remaining error is the ops' (module docstring) plus at
# most two roundings to the parameter dtype (a dequantized wgrad operand or the op's output,
# then the bias add):  |got - ref| <= g + 2 u (|ref| + g),  g = ((K + W + 4) u32 + u) |A| @ |B|.

LAYER_IN, LAYER_OUT = 96, 96  # in/W and out/W multiples of 16 for W = 2 and 3
PARAM = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _ref_quantize(t: torch.Tensor, granularity: str, dtype: torch.dtype) -> torch.Tensor:
    x8, scale = _fp8.quantize(t, dtype, granularity, pow2=granularity == "rows")
    return _deq(x8, scale)


def _ref_layer(kind, recipe, sequence_parallel, save_gathered, x, w, b, gy):
    """Unsharded float64 forward/backward of ``x @ w.T + b`` in the recipe: values and |A|@|B|."""
    (gx, dx), (gw, dw) = _fp8.RECIPES[recipe]["forward"]
    (gg, dg), (gwi, dwi) = _fp8.RECIPES[recipe]["grad_input"]
    xd, wd = _ref_quantize(x, gx, dx), _ref_quantize(w, gw, dw)
    gd, wid = _ref_quantize(gy, gg, dg), _ref_quantize(w, gwi, dwi)
    x_used = xd if (kind == "column" and sequence_parallel and save_gathered) else x
    g_used = gd if (kind == "row" and sequence_parallel) else gy
    return {"y": (xd @ wd.t() + b, xd.abs() @ wd.abs().t() + b.abs()),
            "grad_x": (gd @ wid, gd.abs() @ wid.abs()),
            "grad_w": (g_used.t() @ x_used, g_used.abs().t() @ x_used.abs()),
            "grad_b": (gy.sum(0), gy.abs().sum(0))}


def _layer_shard(kind, name, t, rank, world_size, sequence_parallel):
    """This rank's part of the unsharded ``t`` (value ``name`` of a ``kind`` layer)."""
    def block(dim):
        size = t.shape[dim] // world_size
        return t.narrow(dim, rank * size, size)

    if kind == "column":
        dim = {"y": 1, "grad_x": 0 if sequence_parallel else None, "grad_w": 0, "grad_b": 0}[name]
    else:
        dim = {"y": 0 if sequence_parallel else None, "grad_x": 1, "grad_w": 1, "grad_b": None}[name]
    return t if dim is None else block(dim)


def layer_cases(rank, world_size, cases):
    from tpfuse.nn import ColumnParallelLinear, RowParallelLinear

    report = []
    for index, (kind, recipe, sequence_parallel, save_gathered, dtype_name, strategy) in enumerate(cases):
        dtype = PARAM[dtype_name]
        g = torch.Generator().manual_seed(200 + index)
        tokens = M_SHARD * world_size

        def rnd(*shape, std=1.0):  # values the parameter dtype represents exactly
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype).double()

        x, w, b, gy = rnd(tokens, LAYER_IN), rnd(LAYER_OUT, LAYER_IN, std=0.1), rnd(LAYER_OUT), rnd(tokens, LAYER_OUT)
        ref = _ref_layer(kind, recipe, sequence_parallel, save_gathered, x, w, b, gy)
        kw = dict(sequence_parallel=sequence_parallel, strategy=strategy, fp8=recipe)
        if kind == "column":
            layer = ColumnParallelLinear.from_full(w.to(dtype), b.to(dtype), save_gathered_input=save_gathered, **kw)
            x_in = x[rank * M_SHARD:(rank + 1) * M_SHARD] if sequence_parallel else x
            gy_in = _layer_shard("column", "y", gy, rank, world_size, sequence_parallel)
        else:
            layer = RowParallelLinear.from_full(w.to(dtype), b.to(dtype), **kw)
            x_in = _layer_shard("row", "grad_x", x, rank, world_size, sequence_parallel)
            gy_in = _layer_shard("row", "y", gy, rank, world_size, sequence_parallel)
        x_in = x_in.to(dtype).clone().requires_grad_()
        y = layer(x_in)
        y.backward(gy_in.to(dtype))
        got = {"y": y.detach(), "grad_x": x_in.grad, "grad_w": layer.weight.grad, "grad_b": layer.bias.grad}
        k_of = {"y": LAYER_IN, "grad_x": LAYER_OUT, "grad_w": tokens, "grad_b": tokens}
        row = dict(case=cases[index], ratios={}, ok=True, why=[])
        u = UNIT[dtype]
        for name, value in got.items():
            want, mag = (_layer_shard(kind, name, t, rank, world_size, sequence_parallel) for t in ref[name])
            if value is None or value.dtype != dtype or value.shape != want.shape or not torch.isfinite(value).all():
                row["ok"] = False
                row["why"].append(f"{name}: {None if value is None else (value.dtype, tuple(value.shape))}")
                continue
            gbound = ((k_of[name] + world_size + 4) * 2.0 ** -24 + u) * mag
            bound = gbound + 2 * u * (want.abs() + gbound)
            row["ratios"][name] = ((value.double() - want).abs() / bound).max().item()
        report.append(row)
    return report


LAYER_CASES = [(kind, recipe, sp, True, dtype_name, "ring" if i % 2 else "unfused")
               for i, (kind, recipe, sp, dtype_name) in enumerate(
                   (kind, recipe, sp, dtype_name) for kind in ("column", "row") for recipe in ("tensorwise", "rowwise")
                   for sp in (True, False) for dtype_name in ("bf16", "fp32"))]
LAYER_CASES += [("column", recipe, True, False, "bf16", "auto") for recipe in ("tensorwise", "rowwise")]
LAYER_CASES += [("row", "rowwise", True, True, "bf16", "auto")]


@pytest.mark.parametrize("world_size", [2, 3])
def test_layers_match_unsharded_recipe(rank_pool, world_size):
    cases = LAYER_CASES if world_size == 2 else [c for c in LAYER_CASES if c[4] == "bf16"]  # W = 3: bf16 only
    reports = rank_pool(world_size).run(layer_cases, cases, timeout=240)
    for rank, report in enumerate(reports):
        for row in report:
            assert row["ok"], f"rank {rank} {row['case']}: {row['why']}"
            for name, ratio in row["ratios"].items():
                assert ratio <= 1.0, f"rank {rank} {row['case']} {name}: error {ratio:.2f} x the derived bound"


def compiled_fp8_matches_eager(rank, world_size):
    """torch.compile(fullgraph=True) of the scaled ops and of an fp8 layer equals eager."""
    from tpfuse.nn import ColumnParallelLinear

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(7)
    a8, sa = _quantize(torch.randn(M_SHARD, K, generator=g), "rows")
    b8, sb = _weight(g, N, K, "rows")

    def ops(a8, b8, sa, sb):
        c, a_full, s_full = tpfuse.ag_gemm(a8, b8, scale_a=sa, scale_b=sb, strategy="ring", return_gathered=True)
        d = tpfuse.gemm_ar(a_full, b8, scale_a=s_full, scale_b=sb, out_dtype=torch.float32, strategy="unfused")
        return c, d

    eager = ops(a8, b8, sa, sb)
    compiled = torch.compile(ops, fullgraph=True, backend="aot_eager")(a8, b8, sa, sb)
    same = all(torch.equal(x, y) for x, y in zip(eager, compiled))
    layer = ColumnParallelLinear(K, N * world_size, fp8="rowwise", strategy="ring")
    x = torch.randn(M_SHARD, K, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = layer(x1)
    y1.sum().backward()
    grad_w = layer.weight.grad.clone()
    layer.weight.grad = None
    y2 = torch.compile(layer, fullgraph=True, backend="aot_eager")(x2)
    y2.sum().backward()
    return same and torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad) and torch.equal(grad_w, layer.weight.grad)


def test_torch_compile_fullgraph(rank_pool):
    assert all(rank_pool(2).run(compiled_fp8_matches_eager, timeout=240))


@pytest.mark.parametrize("rows,mode", [(37, "tensor"), (37, "row"), (48, "row"), (5, "tensor")])
def test_scaled_mm_row_padding_keeps_the_product(monkeypatch, rows, mode):
    """The CUDA path pads an fp8 ``a`` to a multiple of 16 rows (cuBLASLt refused 37 rows on the
    H200 bed); forced on here, it must give the unpadded product bit for bit, into ``out`` too."""
    from tpfuse.strategies import _scaled

    g = torch.Generator().manual_seed(rows)
    a = (torch.randn(rows, 32, generator=g) * 2).to(torch.float8_e4m3fn)
    b = (torch.randn(48, 32, generator=g) * 2).to(torch.float8_e4m3fn).t()
    if mode == "tensor":
        sa, sb = torch.tensor(0.75), torch.tensor(1.5)
    else:
        sa, sb = torch.rand(rows, 1, generator=g) + 0.25, torch.rand(1, 48, generator=g) + 0.25
    plain = _scaled.mm(a, b, sa, sb, torch.bfloat16)
    monkeypatch.setattr(_scaled, "_pad_rows", lambda device: True)
    seen, real = [], torch._scaled_mm

    def spy(x, *args, **kwargs):
        seen.append(x.shape[0])
        return real(x, *args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    padded = _scaled.mm(a, b, sa, sb, torch.bfloat16)
    out = torch.full((rows, 48), float("nan"), dtype=torch.bfloat16)
    into = _scaled.mm(a, b, sa, sb, torch.bfloat16, out=out)
    assert padded.shape == (rows, 48) and into is out
    assert seen == [-(-rows // 16) * 16] * 2   # the padded operand reached torch._scaled_mm
    assert torch.equal(padded, plain) and torch.equal(out, plain)
