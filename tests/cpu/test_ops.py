"""The three ops on W gloo ranks, against an unsharded float64 reference.

Every rank builds the same full problem from a seed, runs its shard through the op and compares
its output with the float64 reference.  Tolerances: an op may be off the reference by at most
3x what the ``unfused`` strategy is off in the same dtype (plus a tiny floor); the gathered A
must be bit-exact; NaN/Inf never pass (outputs are poisoned with NaN by TPFUSE_POISON=1).
"""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse import testing
from conftest import caught_then_probe

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
# (rows per rank, K, N): odd, prime-ish sizes, a larger odd one, and empty M.
SHAPES = [(37, 53, 29), (131, 257, 191), (5, 1, 3), (0, 53, 29)]


def _problem(op: str, world_size: int, rows: int, k: int, n: int, seed: int):
    """Full float64 inputs, identical on every rank: (A or per-rank A's, per-rank B's)."""
    g = torch.Generator().manual_seed(seed)
    bs = [torch.randn(k, n, generator=g, dtype=torch.float64) for _ in range(world_size)]
    if op == "ag_gemm":
        return torch.randn(world_size * rows, k, generator=g, dtype=torch.float64), bs
    m = world_size * rows + (1 if op == "gemm_ar" else 0)  # gemm_ar: M need not divide by W
    return [torch.randn(m, k, generator=g, dtype=torch.float64) for _ in range(world_size)], bs


def _call(op, strategy, rank, world_size, a, bs, dtype, transposed_b, group=None):
    """Run ``op`` for this rank; return (output, reference, gathered-or-None, exact-gathered-ref)."""
    b = bs[rank]
    b_in = b.t().contiguous().to(dtype).t() if transposed_b else b.to(dtype)  # weight.t() view
    if transposed_b:
        assert not b_in.is_contiguous() or 1 in b_in.shape or b_in.numel() == 0
    if op == "ag_gemm":
        rows = a.shape[0] // world_size
        a_shard = a[rank * rows:(rank + 1) * rows].to(dtype)
        c, a_full = tpfuse.ag_gemm(a_shard, b_in, group, strategy=strategy, return_gathered=True)
        return c, a.to(dtype).double() @ b_in.double(), a_full, a.to(dtype)
    a_mine = a[rank].to(dtype)
    ref = sum(a[r].to(dtype).double() @ bs[r].to(dtype).double() for r in range(world_size))
    if op == "gemm_rs":
        rows = ref.shape[0] // world_size
        return tpfuse.gemm_rs(a_mine, b_in, group, strategy=strategy), ref[rank * rows:(rank + 1) * rows], None, None
    return tpfuse.gemm_ar(a_mine, b_in, group, strategy=strategy), ref, None, None


def check_op(rank, world_size, op, strategy, dtype_name, shapes, iters=2, stragglers=False):
    dtype = DTYPES[dtype_name]
    report = []
    for shape_index, (rows, k, n) in enumerate(shapes):
        for it in range(iters):
            a, bs = _problem(op, world_size, rows, k, n, seed=1000 * shape_index + it)
            for transposed_b in (False, True):
                if stragglers:
                    time.sleep(random.Random(rank * 7919 + it).uniform(0, 0.05))
                out, ref, gathered, gathered_ref = _call(op, strategy, rank, world_size, a, bs, dtype, transposed_b)
                base, _, _, _ = _call(op, "unfused", rank, world_size, a, bs, dtype, transposed_b)
                report.append(dict(
                    case=(rows, k, n, it, transposed_b),
                    shape_ok=tuple(out.shape) == tuple(ref.shape) and out.dtype == dtype,
                    finite=bool(torch.isfinite(out).all()),
                    err=testing.rel_err(out, ref), err_unfused=testing.rel_err(base, ref),
                    gathered_exact=None if gathered is None else torch.equal(gathered, gathered_ref),
                ))
    return report


def _assert_reports(reports, dtype):
    for rank, report in enumerate(reports):
        for row in report:
            where = f"rank {rank} case {row['case']}"
            assert row["shape_ok"], where
            assert row["finite"], f"{where}: NaN/Inf in output (unwritten element?)"
            assert row["gathered_exact"] in (None, True), f"{where}: gathered A differs from the shards"
            assert row["err"] <= testing.tolerance(dtype, row["err_unfused"]), f"{where}: {row}"
            if dtype == torch.float32:
                assert row["err_unfused"] < 1e-5, f"{where}: the unfused baseline itself is off: {row}"
            elif dtype == torch.bfloat16:
                assert row["err_unfused"] < 3e-2, f"{where}: the unfused baseline itself is off: {row}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
@pytest.mark.parametrize("strategy", ["unfused", "ring", "auto"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_op_matches_reference(rank_pool, world_size, op, strategy, dtype):
    shapes = SHAPES if dtype == "fp32" else SHAPES[:2]
    reports = rank_pool(world_size).run(check_op, op, strategy, dtype, shapes)
    _assert_reports(reports, DTYPES[dtype])


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
def test_float64_and_stragglers(rank_pool, op):
    reports = rank_pool(3).run(check_op, op, "ring", "fp64", [(17, 23, 11)], iters=3, stragglers=True)
    _assert_reports(reports, torch.float64)


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
def test_design_odd_shape(rank_pool, op):
    """DESIGN §1: M/W = 4091, K = 1000, N = 771 must work."""
    reports = rank_pool(2).run(check_op, op, "ring", "fp32", [(4091, 1000, 771)], iters=1)
    _assert_reports(reports, torch.float32)


def ring_matches_unfused_bitwise_for_ag(rank, world_size):
    """AG moves data without arithmetic: ring and unfused gather the very same bytes."""
    a, bs = _problem("ag_gemm", world_size, 9, 13, 7, seed=5)
    a_shard = a[rank * 9:(rank + 1) * 9].float()
    _, full_ring = tpfuse.ag_gemm(a_shard, bs[rank].float(), strategy="ring", return_gathered=True)
    _, full_unfused = tpfuse.ag_gemm(a_shard, bs[rank].float(), strategy="unfused", return_gathered=True)
    return torch.equal(full_ring, full_unfused) and torch.equal(full_ring, a.float())


def test_gathered_a_is_exact(rank_pool):
    assert all(rank_pool(4).run(ring_matches_unfused_bitwise_for_ag))


def gemm_ar_replicas_equal(rank, world_size):
    a, bs = _problem("gemm_ar", world_size, 11, 19, 13, seed=9)
    c = tpfuse.gemm_ar(a[rank].bfloat16(), bs[rank].bfloat16(), strategy="ring")
    everyone = [torch.empty_like(c) for _ in range(world_size)]
    dist.all_gather(everyone, c)
    return all(torch.equal(x, c) for x in everyone)


def test_gemm_ar_output_identical_on_every_rank(rank_pool):
    assert all(rank_pool(3).run(gemm_ar_replicas_equal))


def subgroups(rank, world_size):
    """Two disjoint groups {0, 2} and {1, 3}: group ranks differ from global ranks."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    members = [0, 2] if rank % 2 == 0 else [1, 3]
    errs = []
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        a, bs = _problem(op, 2, 6, 10, 4, seed=3 + rank % 2)
        out, ref, _, _ = _call(op, "ring", members.index(rank), 2, a, bs, torch.float32, False, group=group)
        errs.append(testing.rel_err(out, ref))
    return max(errs)


def test_subgroups(rank_pool):
    assert max(rank_pool(4).run(subgroups)) < 1e-5


# ---------------------------------------------------------------------------------------------
# Bad input: an error on every rank, before any communication, and the group stays usable.
# ---------------------------------------------------------------------------------------------

def _bad_call(case: str, rank: int, world_size: int):
    f32 = torch.float32
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    if case == "3d":
        return lambda: tpfuse.ag_gemm(torch.randn(2, 4, 6), b)
    if case == "not_tensor":
        return lambda: tpfuse.gemm_rs([[1.0]], b)
    if case == "dtype_mismatch":
        return lambda: tpfuse.gemm_ar(a, b.double())
    if case == "int_dtype":
        return lambda: tpfuse.gemm_ar(a.int(), b.int())
    if case == "k_mismatch":
        return lambda: tpfuse.ag_gemm(a, torch.randn(7, 5))
    if case == "m_not_divisible":
        return lambda: tpfuse.gemm_rs(torch.randn(world_size * 4 + 1, 6), b)
    if case == "unknown_strategy":
        return lambda: tpfuse.gemm_rs(a.repeat(world_size, 1), b, strategy="magic")
    if case == "copy_engine_on_gloo":
        return lambda: tpfuse.ag_gemm(a, b, strategy="copy_engine")
    if case == "fused_on_gloo":
        return lambda: tpfuse.gemm_rs(a.repeat(world_size, 1), b, strategy="fused")
    if case == "fused_fp64":
        return lambda: tpfuse.gemm_ar(a.double(), b.double(), strategy="fused")
    if case == "return_gathered_not_bool":
        return lambda: tpfuse.ag_gemm(a, b, return_gathered=1)
    if case == "bad_group":
        return lambda: tpfuse.gemm_ar(a, b, group="world")
    if case == "one_rank_bad":  # only the last rank passes a wrong K
        return lambda: tpfuse.ag_gemm(a, torch.randn(7 if rank == world_size - 1 else 6, 5, dtype=f32))
    if case == "ranks_disagree":  # every rank valid on its own, but M/W differs
        return lambda: tpfuse.ag_gemm(torch.randn(4 + rank, 6), b)
    raise AssertionError(case)


BAD_CASES = {
    "3d": (ValueError, "2-D"), "not_tensor": (TypeError, "torch.Tensor"),
    "dtype_mismatch": (TypeError, "cast"), "int_dtype": (TypeError, "not supported"),
    "k_mismatch": (ValueError, "weight.t()"), "m_not_divisible": (ValueError, "divisible"),
    "unknown_strategy": (ValueError, "magic"), "copy_engine_on_gloo": (ValueError, "symmetric memory"),
    "fused_on_gloo": (ValueError, "fused needs CUDA symmetric memory"),
    "fused_fp64": (ValueError, "float64"), "return_gathered_not_bool": (TypeError, "return_gathered"),
    "bad_group": (TypeError, "ProcessGroup"), "one_rank_bad": (ValueError, "invalid input on rank(s) [1]"),
    "ranks_disagree": (ValueError, "disagree"),
}


def raise_on_bad_input(rank, world_size, case):
    return caught_then_probe(rank, _bad_call(case, rank, world_size))   # the group must still work


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_raises_on_every_rank(rank_pool, case):
    world_size = 2
    expected_type, expected_text = BAD_CASES[case]
    results = rank_pool(world_size).run(raise_on_bad_input, case, timeout=60)
    for rank, (caught, probe) in enumerate(results):
        assert caught is not None, f"rank {rank}: no error for {case}"
        assert caught[0] == expected_type.__name__, f"rank {rank}: {caught}"
        if case == "one_rank_bad" and rank == world_size - 1:
            expected_text = "inner dimensions"  # the bad rank gets its own precise message
        assert expected_text in caught[1], f"rank {rank}: {caught[1]!r} should mention {expected_text!r}"
        assert probe == sum(range(world_size))


def test_needs_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        tpfuse.ag_gemm(torch.randn(2, 3), torch.randn(3, 4))


# ---------------------------------------------------------------------------------------------
# Custom ops: fake implementations and torch.compile
# ---------------------------------------------------------------------------------------------

def fake_shapes(rank, world_size):
    from torch._subclasses.fake_tensor import FakeTensorMode

    name = dist.group.WORLD.group_name
    with FakeTensorMode():
        a, b = torch.empty(5, 7), torch.empty(7, 3)
        c, a_full = torch.ops.tpfuse.ag_gemm(a, b, name, "ring")
        rs = torch.ops.tpfuse.gemm_rs(torch.empty(5 * world_size, 7), b, name, "ring")
        ar = torch.ops.tpfuse.gemm_ar(a, b, name, "unfused")
    return tuple(c.shape), tuple(a_full.shape), tuple(rs.shape), tuple(ar.shape)


def test_fake_impls(rank_pool):
    for shapes in rank_pool(2).run(fake_shapes):
        assert shapes == ((10, 3), (10, 7), (5, 3), (5, 3))


def compiled_matches_eager(rank, world_size):
    torch._dynamo.reset()

    def mlp(x_shard, w1, w2):
        h = tpfuse.ag_gemm(x_shard, w1.t(), strategy="ring")
        return tpfuse.gemm_rs(torch.relu(h), w2.t(), strategy="ring")

    g = torch.Generator().manual_seed(rank)
    x, w1, w2 = torch.randn(6, 8, generator=g), torch.randn(10, 8, generator=g), torch.randn(8, 10, generator=g)
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    return torch.equal(compiled(x, w1, w2), mlp(x, w1, w2))


def test_torch_compile_fullgraph(rank_pool):
    assert all(rank_pool(2).run(compiled_matches_eager, timeout=180))


def compiled_auto_matches_eager(rank, world_size):
    """The default strategy="auto" is resolved at trace time (the planner is not traceable)."""
    torch._dynamo.reset()

    def fc1(x_shard, w1):
        return tpfuse.ag_gemm(x_shard, w1.t())

    g = torch.Generator().manual_seed(rank)
    x, w1 = torch.randn(6, 8, generator=g), torch.randn(10, 8, generator=g)
    compiled = torch.compile(fc1, fullgraph=True, backend="aot_eager")
    return torch.equal(compiled(x, w1), fc1(x, w1))


def test_torch_compile_fullgraph_auto(rank_pool):
    assert all(rank_pool(2).run(compiled_auto_matches_eager, timeout=180))
