"""tpfuse.nn layers and the custom ops' autograd on W gloo ranks, against unsharded references.

The model under test is the Megatron MLP block ``fc2(gelu(fc1(x)))`` with ``fc1`` a
ColumnParallelLinear and ``fc2`` a RowParallelLinear.  Every rank builds the same full problem
from a seed and checks its shard of the output and of every gradient against

* the unsharded float64 model (``torch.nn.functional.linear``) on the same dtype-rounded
  parameters: error at most 3x the ``unfused`` strategy's own error in the same dtype, plus a
  small floor (float64: 1e-12 relative);
* a per-rank reference written with plain torch ops the way the layers compute the shard, from
  the gathered input/output gradient and the layers' own activation ``fc1(x)`` and its
  gradient: the weight gradients and the column bias gradient involve no cross-rank reduction,
  so they must be bit-for-bit equal (as must the row bias gradient without SP).

Outputs of the ops are poisoned with NaN (TPFUSE_POISON=1 in the pools), so NaN/Inf fail.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpfuse
from tpfuse import testing
from tpfuse.nn import ColumnParallelLinear, RowParallelLinear

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
HIDDEN, FFN = 13, 28  # odd hidden size (nothing needs it to divide); FFN divides by 1, 2 and 4
TOKENS_PER_RANK = 5
GRADS = ("y", "x", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def _problem(world_size: int, lead_rest: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    """Full float64 parameters, input and output gradient, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    lead = (TOKENS_PER_RANK * world_size, *lead_rest)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    return dict(w1=rnd(FFN, HIDDEN), b1=rnd(FFN), w2=rnd(HIDDEN, FFN), b2=rnd(HIDDEN), x=rnd(*lead, HIDDEN),
                gy=rnd(*lead, HIDDEN))


def _block(t: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    size = t.shape[dim] // world_size
    return t.narrow(dim, rank * size, size)


def _unsharded_reference(p, dtype):
    """fp64 forward/backward of the unsharded MLP on the dtype-rounded parameters."""
    q = {k: v.to(dtype).double().clone().requires_grad_() for k, v in p.items() if k != "gy"}
    y = F.linear(F.gelu(F.linear(q["x"], q["w1"], q["b1"])), q["w2"], q["b2"])
    y.backward(p["gy"].to(dtype).double())
    return {"y": y.detach(), "x": q["x"].grad, "fc1.weight": q["w1"].grad, "fc1.bias": q["b1"].grad,
            "fc2.weight": q["w2"].grad, "fc2.bias": q["b2"].grad}


def _sharded_reference(p, dtype, h, grad_h):
    """This rank's reduction-free gradients, computed with plain torch ops the way the layers
    compute them, from the layers' own activation ``h`` = fc1(x) and its gradient (so that the
    check does not depend on how a strategy chunks its GEMMs)."""
    x_full = p["x"].to(dtype).reshape(-1, HIDDEN)  # the gathered input (SP) or the replicated one
    grad_y = p["gy"].to(dtype).reshape(-1, HIDDEN)  # the gathered output grad (SP) or the replicated one
    h, grad_h = h.reshape(x_full.shape[0], -1), grad_h.reshape(x_full.shape[0], -1)
    return {"fc1.weight": torch.matmul(grad_h.t(), x_full), "fc1.bias": grad_h.sum(0),
            "fc2.weight": torch.matmul(grad_y.t(), F.gelu(h))}


def _run_layers(p, dtype, rank, world_size, *, sequence_parallel, strategy, save_gathered_input=True):
    fc1 = ColumnParallelLinear.from_full(p["w1"].to(dtype), p["b1"].to(dtype), sequence_parallel=sequence_parallel,
                                         strategy=strategy, save_gathered_input=save_gathered_input)
    fc2 = RowParallelLinear.from_full(p["w2"].to(dtype), p["b2"].to(dtype), sequence_parallel=sequence_parallel,
                                      strategy=strategy)
    x, gy = p["x"].to(dtype), p["gy"].to(dtype)
    if sequence_parallel:
        x, gy = _block(x, rank, world_size), _block(gy, rank, world_size)
    x = x.clone().requires_grad_()
    h = fc1(x)
    h.retain_grad()
    y = fc2(F.gelu(h))
    y.backward(gy)
    return {"y": y.detach(), "x": x.grad, "fc1.weight": fc1.weight.grad, "fc1.bias": fc1.bias.grad,
            "fc2.weight": fc2.weight.grad, "fc2.bias": fc2.bias.grad}, h.detach(), h.grad


def _shard_of_reference(name, ref, rank, world_size, sequence_parallel):
    if name in ("y", "x"):
        return _block(ref, rank, world_size) if sequence_parallel else ref
    if name in ("fc1.weight", "fc1.bias"):
        return _block(ref, rank, world_size)
    if name == "fc2.weight":
        return _block(ref, rank, world_size, dim=1)
    return ref  # fc2.bias: replicated, full gradient on every rank


def mlp_cases(rank, world_size, strategy, cases):
    """For each case: errors of ``strategy`` and of ``unfused`` vs the fp64 model, exactness of
    the reduction-free gradients, and finiteness/shape of everything."""
    report = []
    for index, (dtype_name, sequence_parallel, lead_rest, save_gathered_input) in enumerate(cases):
        dtype = DTYPES[dtype_name]
        p = _problem(world_size, lead_rest, seed=100 + index)
        ref = _unsharded_reference(p, dtype)
        row = dict(case=cases[index], errors={}, errors_unfused={}, exact={}, finite=True, shapes_ok=True)
        for strat, errors in ((strategy, row["errors"]), ("unfused", row["errors_unfused"])):
            got, h, grad_h = _run_layers(p, dtype, rank, world_size, sequence_parallel=sequence_parallel,
                                         strategy=strat, save_gathered_input=save_gathered_input)
            same_way = _sharded_reference(p, dtype, h, grad_h)
            for name in GRADS:
                want = _shard_of_reference(name, ref[name], rank, world_size, sequence_parallel)
                row["shapes_ok"] &= tuple(got[name].shape) == tuple(want.shape) and got[name].dtype == dtype
                row["finite"] &= bool(torch.isfinite(got[name]).all())
                errors[name] = testing.rel_err(got[name], want)
                if strat == strategy and name in same_way:
                    row["exact"][name] = torch.equal(got[name], same_way[name])
            if strat == strategy and not sequence_parallel:
                row["exact"]["fc2.bias"] = torch.equal(got["fc2.bias"], p["gy"].to(dtype).reshape(-1, HIDDEN).sum(0))
        report.append(row)
    return report


def _assert_mlp_reports(reports):
    for rank, report in enumerate(reports):
        for row in report:
            where = f"rank {rank} case {row['case']}"
            dtype = DTYPES[row["case"][0]]
            assert row["shapes_ok"], where
            assert row["finite"], f"{where}: NaN/Inf (unwritten output element?)"
            assert all(row["exact"].values()), f"{where}: reduction-free gradients differ bitwise: {row['exact']}"
            for name in GRADS:
                err, base = row["errors"][name], row["errors_unfused"][name]
                if dtype == torch.float64:
                    assert err < 1e-12, f"{where}: {name} off the fp64 model by {err:.2e}"
                else:
                    assert err <= testing.tolerance(dtype, base), f"{where}: {name} {err:.2e} vs unfused {base:.2e}"
                    limit = 1e-5 if dtype == torch.float32 else 3e-2
                    assert base < limit, f"{where}: the unfused baseline itself is off for {name}: {base:.2e}"


# (dtype, sequence_parallel, leading dims after dim 0, save_gathered_input)
MLP_CASES = [
    ("fp64", True, (), True),
    ("fp64", True, (3,), False),
    ("fp64", False, (2, 3), True),
    ("bf16", True, (3,), True),
    ("bf16", False, (), True),
    ("fp32", True, (), False),
]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("strategy", ["unfused", "ring"])
def test_mlp_matches_reference(rank_pool, world_size, strategy):
    _assert_mlp_reports(rank_pool(world_size).run(mlp_cases, strategy, MLP_CASES))


def test_mlp_auto_strategy(rank_pool):
    _assert_mlp_reports(rank_pool(2).run(mlp_cases, "auto", MLP_CASES[:1] + MLP_CASES[3:4]))


# --------------------------------------------------------------------------------------------
# Replicated bias, leading dims, no-bias layers
# --------------------------------------------------------------------------------------------


def replicated_bias_after_steps(rank, world_size, sequence_parallel):
    """Three SGD steps of the MLP; the row layer's (replicated) bias must stay equal everywhere."""
    torch.manual_seed(rank)  # every rank draws different data: only the all-reduce keeps replicas equal
    fc1 = ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=sequence_parallel, dtype=torch.bfloat16)
    fc2 = RowParallelLinear(FFN, HIDDEN, sequence_parallel=sequence_parallel, dtype=torch.bfloat16)
    opt = torch.optim.SGD([*fc1.parameters(), *fc2.parameters()], lr=0.1)
    grads = []
    for _ in range(3):
        x = torch.randn(4 * world_size if not sequence_parallel else 4, HIDDEN, dtype=torch.bfloat16)
        if not sequence_parallel:  # replicated input: same on every rank
            dist.broadcast(x, src=0)
        y = fc2(F.gelu(fc1(x)))
        opt.zero_grad()
        y.float().square().mean().backward()
        grads.append(fc2.bias.grad.clone())
        opt.step()
    everyone = [torch.empty_like(fc2.bias) for _ in range(world_size)]
    dist.all_gather(everyone, fc2.bias.detach())
    grads_everyone = [torch.empty_like(grads[0]) for _ in range(world_size)]
    dist.all_gather(grads_everyone, grads[0])
    return (all(torch.equal(b, fc2.bias) for b in everyone), all(torch.equal(g, grads[0]) for g in grads_everyone),
            bool(fc2.bias.ne(0).any()))


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_replicated_bias_stays_equal(rank_pool, sequence_parallel):
    for params_equal, grads_equal, moved in rank_pool(4).run(replicated_bias_after_steps, sequence_parallel):
        assert grads_equal and params_equal and moved


def leading_dim_shapes(rank, world_size):
    shapes = {}
    for sp in (True, False):
        fc1 = ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=sp, strategy="ring", dtype=torch.float64)
        fc2 = RowParallelLinear(FFN, HIDDEN, sequence_parallel=sp, strategy="ring", dtype=torch.float64,
                                bias=False)
        for lead in ((2,), (2, 3), (2, 1, 3)):
            h = fc1(torch.randn(*lead, HIDDEN, dtype=torch.float64))
            shapes[(sp, lead)] = (tuple(h.shape), tuple(fc2(h).shape))
    fc2 = RowParallelLinear(FFN, HIDDEN, dtype=torch.float64)
    try:
        fc2(torch.randn(world_size + 1, 2 * world_size, FFN // world_size, dtype=torch.float64))
        shapes["row_dim0_error"] = None
    except ValueError as exc:
        shapes["row_dim0_error"] = str(exc)
    return shapes


def test_leading_dims(rank_pool):
    """SP shards dim 0: column output dim 0 is W x input's; row output dim 0 is input's / W."""
    w = 2
    for shapes in rank_pool(w).run(leading_dim_shapes):
        for lead in ((2,), (2, 3), (2, 1, 3)):
            assert shapes[(True, lead)] == ((w * lead[0], *lead[1:], FFN // w), (*lead, HIDDEN))
            assert shapes[(False, lead)] == ((*lead, FFN // w), (*lead, HIDDEN))
        assert "dim 0 of the input (3" in shapes["row_dim0_error"] and "pad dim 0 to 4" in shapes["row_dim0_error"]


# --------------------------------------------------------------------------------------------
# Custom-op autograd used directly (public ops), incl. the gathered output's gradient
# --------------------------------------------------------------------------------------------


def ops_autograd(rank, world_size, strategy):
    g = torch.Generator().manual_seed(7)
    m, k, n = 3 * world_size, 11, 5
    a = torch.randn(m, k, generator=g, dtype=torch.float64)
    bs = [torch.randn(k, n, generator=g, dtype=torch.float64) for _ in range(world_size)]
    grad_c = [torch.randn(m, n, generator=g, dtype=torch.float64) for _ in range(world_size)]
    grad_full = [torch.randn(m, k, generator=g, dtype=torch.float64) for _ in range(world_size)]
    rows = slice(rank * 3, rank * 3 + 3)
    errs = {}

    # ag_gemm with both outputs used: grad_a_shard = RS(grad_c @ b.T + grad_a_full)
    a_shard, b = a[rows].clone().requires_grad_(), bs[rank].clone().requires_grad_()
    c, a_full = tpfuse.ag_gemm(a_shard, b, strategy=strategy, return_gathered=True)
    torch.autograd.backward([c, a_full], [grad_c[rank], grad_full[rank]])
    want_a = sum(grad_c[r] @ bs[r].t() + grad_full[r] for r in range(world_size))[rows]
    errs["ag_gemm a"] = testing.rel_err(a_shard.grad, want_a)
    errs["ag_gemm b"] = testing.rel_err(b.grad, a.t() @ grad_c[rank])

    # gemm_rs on a weight.t() view: the weight's grad is contiguous [N, K]
    a_mine = (a * (rank + 1)).requires_grad_()
    weight = bs[rank].t().contiguous().requires_grad_()
    c_shard = tpfuse.gemm_rs(a_mine, weight.t(), strategy=strategy)
    c_shard.backward(grad_c[0][rows])
    errs["gemm_rs a"] = testing.rel_err(a_mine.grad, grad_c[0] @ bs[rank].t())
    errs["gemm_rs b"] = testing.rel_err(weight.grad, (a_mine.detach().t() @ grad_c[0]).t())
    contiguous = weight.grad.is_contiguous()

    # gemm_ar: grad_c is the same on every rank (Megatron convention), no communication
    a_mine.grad = None
    b = bs[rank].clone().requires_grad_()
    tpfuse.gemm_ar(a_mine, b, strategy=strategy).backward(grad_c[0])
    errs["gemm_ar a"] = testing.rel_err(a_mine.grad, grad_c[0] @ bs[rank].t())
    errs["gemm_ar b"] = testing.rel_err(b.grad, a_mine.detach().t() @ grad_c[0])
    return errs, contiguous


@pytest.mark.parametrize("strategy", ["unfused", "ring"])
def test_ops_autograd(rank_pool, strategy):
    for errs, contiguous in rank_pool(2).run(ops_autograd, strategy):
        assert contiguous, "the grad of weight through weight.t() should be a contiguous [N, K] matrix"
        assert all(e < 1e-12 for e in errs.values()), errs


def frozen_weights(rank, world_size, save_gathered_input):
    """MLP with frozen weights (requires_grad False): the input gradient is still right, and
    no saved tensor is as large as a gathered/full activation (only weights and small shards)."""
    torch.manual_seed(3)
    rows = 64  # per rank: every token activation is larger than a weight shard ([FFN/W, HIDDEN])
    tokens = rows * world_size
    x_full = torch.randn(tokens, HIDDEN, dtype=torch.float64)
    gy_full = torch.randn(tokens, HIDDEN, dtype=torch.float64)
    results = {}
    for sp in (True, False):
        fc1 = ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=sp, strategy="ring", dtype=torch.float64,
                                   save_gathered_input=save_gathered_input)
        fc2 = RowParallelLinear(FFN, HIDDEN, sequence_parallel=sp, strategy="ring", dtype=torch.float64)
        for mod in (fc1, fc2):
            mod.requires_grad_(False)
        w1, w2 = _gather_cols(fc1.weight, world_size), _gather_rows(fc2.weight, world_size)
        x = (x_full[rank * rows:(rank + 1) * rows] if sp else x_full).clone().requires_grad_()
        gy = gy_full[rank * rows:(rank + 1) * rows] if sp else gy_full
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(tuple(t.shape)), t)[1], lambda t: t):
            out = fc2(fc1(x))
        out.backward(gy)
        # reference: linear layers without activation, so dx = gy @ W2 @ W1 summed over everything
        want = (gy_full @ w2 @ w1)
        want = want[rank * rows:(rank + 1) * rows] if sp else want
        biggest = max((math.prod(s) for s in saved), default=0)
        results[sp] = (testing.rel_err(x.grad, want), biggest, fc1.weight.grad is None and fc2.weight.grad is None)
    return results


def _gather_cols(w_local, world_size):  # [out/W, in] shards -> full [out, in]
    parts = [torch.empty_like(w_local) for _ in range(world_size)]
    dist.all_gather(parts, w_local.detach().contiguous())
    return torch.cat(parts, 0)


def _gather_rows(w_local, world_size):  # [out, in/W] shards -> full [out, in]
    parts = [torch.empty_like(w_local) for _ in range(world_size)]
    dist.all_gather(parts, w_local.detach().contiguous())
    return torch.cat(parts, 1)


@pytest.mark.parametrize("save_gathered_input", [True, False])
def test_frozen_weights_save_no_activations(rank_pool, save_gathered_input):
    w = 2
    for per_rank in rank_pool(w).run(frozen_weights, save_gathered_input):
        for sp, (err, biggest, no_wgrad) in per_rank.items():
            assert err < 1e-12, (sp, err)
            assert no_wgrad
            # the largest saved tensor is a weight shard ([FFN/W, HIDDEN]), never a token activation
            assert biggest <= FFN // w * HIDDEN, (sp, biggest)


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def constructor_errors(rank, world_size):
    cases = {
        "col_out": lambda: ColumnParallelLinear(16, 10),
        "row_in": lambda: RowParallelLinear(10, 16),
        "type": lambda: ColumnParallelLinear(16.0, 16),
        "zero": lambda: RowParallelLinear(16, 0),
        "strategy": lambda: ColumnParallelLinear(16, 16, strategy="fastest"),
        "flag": lambda: RowParallelLinear(16, 16, sequence_parallel="yes"),
        "from_full_shape": lambda: ColumnParallelLinear(16, 16).load_full_weight(torch.zeros(16, 8)),
        "from_full_bias": lambda: RowParallelLinear(16, 16, bias=False).load_full_weight(torch.zeros(16, 16),
                                                                                        torch.zeros(16)),
    }
    out = {}
    for name, make in cases.items():
        try:
            make()
            out[name] = None
        except (TypeError, ValueError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    return out


def test_constructor_validation(rank_pool):
    for errors in rank_pool(4).run(constructor_errors):
        assert errors["col_out"][0] == "ValueError"
        assert "out_features = 10" in errors["col_out"][1] and "world size 4" in errors["col_out"][1]
        assert "use out_features = 12 or 8" in errors["col_out"][1]
        assert errors["row_in"][0] == "ValueError" and "in_features = 10" in errors["row_in"][1]
        assert errors["type"][0] == "TypeError" and "in_features" in errors["type"][1]
        assert errors["zero"][0] == "ValueError" and "out_features = 0" in errors["zero"][1]
        assert errors["strategy"][0] == "ValueError" and "'fastest'" in errors["strategy"][1]
        assert errors["flag"][0] == "TypeError" and "sequence_parallel" in errors["flag"][1]
        assert errors["from_full_shape"][0] == "ValueError" and "[16, 16]" in errors["from_full_shape"][1]
        assert errors["from_full_bias"][0] == "ValueError" and "bias=False" in errors["from_full_bias"][1]


def bad_input_on_one_rank(rank, world_size, case):
    fc1 = ColumnParallelLinear(HIDDEN, FFN, strategy="ring")
    x = torch.randn(3, HIDDEN)
    if rank == world_size - 1:
        x = {"features": torch.randn(3, HIDDEN + 1), "dtype": x.double(), "dims": torch.randn(HIDDEN)}[case]
    try:
        fc1(x)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("case", ["features", "dtype", "dims"])
def test_bad_input_raises_on_every_rank(rank_pool, case):
    """A bad input on one rank only raises on every rank (no rank left waiting in a collective)."""
    start = time.monotonic()
    results = rank_pool(2).run(bad_input_on_one_rank, case, timeout=60)
    assert time.monotonic() - start < 30
    assert all(r is not None for r in results), results
    culprit = results[-1][1]
    assert {"features": "last dim is 14", "dtype": "torch.float64", "dims": "at least 2 dims"}[case] in culprit
    assert "rank(s) [1]" in results[0][1]


def test_needs_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in the test process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ColumnParallelLinear(8, 8)


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------


def compiled_mlp_matches_eager(rank, world_size, backend, variants):
    torch._dynamo.reset()
    p = _problem(world_size, (3,), seed=11)
    results = []
    for sequence_parallel, save_gathered_input, strategy in variants:
        runs = []
        for compiled in (False, True):
            fc1 = ColumnParallelLinear.from_full(p["w1"].float(), p["b1"].float(), sequence_parallel=sequence_parallel,
                                                 save_gathered_input=save_gathered_input, strategy=strategy)
            fc2 = RowParallelLinear.from_full(p["w2"].float(), p["b2"].float(), sequence_parallel=sequence_parallel,
                                              strategy=strategy)

            def mlp(x, fc1=fc1, fc2=fc2):
                return fc2(F.gelu(fc1(x)))

            fn = torch.compile(mlp, fullgraph=True, backend=backend) if compiled else mlp
            x, gy = p["x"].float(), p["gy"].float()
            if sequence_parallel:
                x, gy = _block(x, rank, world_size), _block(gy, rank, world_size)
            x = x.clone().requires_grad_()
            for _ in range(2):  # a second call reuses the compiled graph
                for param in (*fc1.parameters(), *fc2.parameters()):
                    param.grad = None
                x.grad = None
                y = fn(x)
                y.backward(gy)
            runs.append([y.detach(), x.grad, fc1.weight.grad, fc1.bias.grad, fc2.weight.grad, fc2.bias.grad])
        eager, comp = runs
        results.append(max(testing.rel_err(c, e.double()) for c, e in zip(comp, eager)))
    return results


def test_torch_compile_fullgraph_aot_eager(rank_pool):
    variants = [(True, True, "ring"), (True, False, "auto"), (False, True, "unfused")]
    for errs in rank_pool(2).run(compiled_mlp_matches_eager, "aot_eager", variants, timeout=240):
        assert all(e == 0.0 for e in errs), errs


def test_torch_compile_fullgraph_inductor(rank_pool):
    start = time.monotonic()
    for errs in rank_pool(2).run(compiled_mlp_matches_eager, "inductor", [(True, True, "ring")], timeout=240):
        assert all(e < 1e-5 for e in errs), errs  # inductor may fuse gelu and reorder its arithmetic
    assert time.monotonic() - start < 120


def compiled_graph_count(rank, world_size, strategy):
    """Graphs Dynamo builds for two token counts under dynamic=True, and the max error vs eager."""
    torch._dynamo.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    p = _problem(world_size, (), seed=12)
    fc1 = ColumnParallelLinear.from_full(p["w1"], p["b1"], strategy=strategy)
    fc2 = RowParallelLinear.from_full(p["w2"], p["b2"], strategy=strategy)

    def mlp(x):
        return fc2(F.gelu(fc1(x)))

    compiled = torch.compile(mlp, fullgraph=True, dynamic=True, backend=counting_backend)
    err = 0.0
    for tokens in (3, 5):
        x = torch.randn(tokens, HIDDEN, dtype=torch.float64, requires_grad=True)
        y = compiled(x)
        y.sum().backward()
        x_eager = x.detach().clone().requires_grad_()
        y_eager = mlp(x_eager)
        y_eager.sum().backward()
        err = max(err, testing.rel_err(y, y_eager.detach()), testing.rel_err(x.grad, x_eager.grad))
    return len(graphs), err


def test_torch_compile_dynamic_shapes(rank_pool):
    """A named strategy keeps token counts dynamic (one graph); "auto" specializes per size."""
    for count, err in rank_pool(2).run(compiled_graph_count, "ring", timeout=240):
        assert count == 1 and err < 1e-12, (count, err)
    for count, err in rank_pool(2).run(compiled_graph_count, "auto", timeout=240):
        assert count == 2 and err < 1e-12, (count, err)


def mlp_on_subgroups(rank, world_size):
    """Two TP groups of 2 ranks ({0, 1} and {2, 3}), each training on its own data."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    group_rank = rank % 2
    p = _problem(2, (3,), seed=20 + rank // 2)
    ref = _unsharded_reference(p, torch.float64)
    fc1 = ColumnParallelLinear.from_full(p["w1"], p["b1"], group=group, strategy="ring")
    fc2 = RowParallelLinear.from_full(p["w2"], p["b2"], group=group, strategy="ring")
    x = _block(p["x"], group_rank, 2).clone().requires_grad_()
    y = fc2(F.gelu(fc1(x)))
    y.backward(_block(p["gy"], group_rank, 2))
    got = {"y": y.detach(), "x": x.grad, "fc1.weight": fc1.weight.grad, "fc1.bias": fc1.bias.grad,
           "fc2.weight": fc2.weight.grad, "fc2.bias": fc2.bias.grad}
    return max(testing.rel_err(got[name], _shard_of_reference(name, ref[name], group_rank, 2, True)) for name in GRADS)


def test_subgroups(rank_pool):
    assert all(err < 1e-12 for err in rank_pool(4).run(mlp_on_subgroups))


def test_example_trains_and_matches_reference():
    """examples/tp_mlp_train.py runs on 2 spawned CPU ranks and its check passes."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tp_mlp_train.py")
    done = subprocess.run([sys.executable, script, "--world-size", "2", "--steps", "3"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 2: loss" in done.stdout and "match the unsharded reference" in done.stdout, done.stdout


def test_example_trains_in_fp8():
    """``--fp8 rowwise``: a short run whose bf16-reference check (windowed mean losses) passes."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tp_mlp_train.py")
    done = subprocess.run([sys.executable, script, "--world-size", "2", "--steps", "20", "--fp8", "rowwise",
                           "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 19: loss" in done.stdout and "follow the bfloat16 reference" in done.stdout, done.stdout
