"""Issue 21: `auto` is one decision for the whole group, bad input on one rank cannot leave another
waiting, edge shapes work, diagnostics name what differs.

Multi-rank cases run on gloo ranks with the per-call agreement round on (``TPFUSE_DEBUG=1``, the
test default) and off (``TPFUSE_DEBUG=0``, what NCCL users get), each bounded by a job timeout
well below the process-group timeout: a hang fails the test in seconds.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.spawn import RankPool
from conftest import TEST_RANK_ENV, caught_then_probe

JOB_TIMEOUT = 30  # s; the process group's own timeout in these pools is 120 s


@pytest.fixture(scope="module")
def pools(rank_pool):
    """``pools(mode, W)``: "on" = the shared test pools (per-call round on), "off" = pools with
    ``TPFUSE_DEBUG=0`` (rounds only on new signatures, as NCCL users get), started lazily."""
    made: dict[int, RankPool] = {}

    def get(mode: str, world_size: int) -> RankPool:
        if mode == "on":
            return rank_pool(world_size)
        pool = made.get(world_size)
        if pool is None or not pool.alive:
            pool = made[world_size] = RankPool(world_size, env=dict(TEST_RANK_ENV, TPFUSE_DEBUG="0"))
        return pool

    yield get
    for pool in made.values():
        pool.close()


def _decided(op, a, b):
    """The strategy this rank's cached decision holds for (a, b) under auto."""
    from tpfuse import ops
    from tpfuse._dist import group_context

    return ops.resolve_strategy(op, "auto", a, b, group_context(None))


# ---------------------------------------------------------------------------------------------
# 21.1 auto is rank-consistent (per-rank N / K, per-rank tuning caches), 21.5 without the round
# ---------------------------------------------------------------------------------------------

def auto_with_per_rank_sizes_and_caches(rank, world_size, op, cache_root, salt):
    """Each rank has its own local size (N for ag_gemm, K otherwise) and its own tuning cache,
    which says ring is fastest on even ranks and unfused on odd ones for that rank's own shape."""
    from tpfuse.plan import record_measurement

    local = 3 + 5 * rank  # differs on every rank
    rows = 8 + salt  # a signature no earlier job used (decisions are cached per signature)
    fixed = 6
    g = torch.Generator().manual_seed(42)
    if op == "ag_gemm":
        a_full = torch.randn(world_size * rows, fixed, generator=g, dtype=torch.float64)
        bs = [torch.randn(fixed, 3 + 5 * r, generator=g, dtype=torch.float64) for r in range(world_size)]
        a, b = a_full[rank * rows:(rank + 1) * rows], bs[rank]
        ref = a_full @ b
        m, n, k = world_size * rows, local, fixed
    else:
        m = world_size * rows
        a_all = [torch.randn(m, 3 + 5 * r, generator=g, dtype=torch.float64) for r in range(world_size)]
        bs = [torch.randn(3 + 5 * r, fixed, generator=g, dtype=torch.float64) for r in range(world_size)]
        a, b = a_all[rank], bs[rank]
        ref = sum(x @ y for x, y in zip(a_all, bs))
        if op == "gemm_rs":
            ref = ref[rank * rows:(rank + 1) * rows]
        n, k = fixed, local
    old = os.environ.get("TPFUSE_CACHE_DIR")
    os.environ["TPFUSE_CACHE_DIR"] = os.path.join(cache_root, f"rank{rank}")
    try:
        fast, slow = ("ring", "unfused") if rank % 2 == 0 else ("unfused", "ring")
        for strategy, ms in ((fast, 0.001), (slow, 1.0)):
            record_measurement(op, m=m, n=n, k=k, world_size=world_size, dtype="fp32", hardware="cpu-gloo",
                               strategy=strategy, ms=ms)
        a32, b32 = a.float(), b.float()
        fn = getattr(tpfuse, op)
        out = fn(a32, b32)
        again = fn(a32, b32)  # the cached decision: no round unless per-call
        chosen = _decided(op, a32, b32)
    finally:
        if old is None:
            os.environ.pop("TPFUSE_CACHE_DIR")
        else:
            os.environ["TPFUSE_CACHE_DIR"] = old
    err = max((x.double() - ref).abs().max().item() for x in (out, again))
    return chosen, err / ref.abs().max().item()


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
def test_auto_is_one_decision_for_the_group(pools, tmp_path, mode, world_size, op):
    salt = {"ag_gemm": 0, "gemm_rs": 1, "gemm_ar": 2}[op] + 3 * (world_size + (mode == "on"))
    results = pools(mode, world_size).run(auto_with_per_rank_sizes_and_caches, op, str(tmp_path), salt,
                                          timeout=JOB_TIMEOUT)
    chosen = {c for c, _ in results}
    assert len(chosen) == 1, f"ranks chose differently: {results}"
    # rank 0 holds the largest local size?  No: the largest is the last rank's; its cache decides.
    last_rank_fast = "ring" if (world_size - 1) % 2 == 0 else "unfused"
    assert chosen == {last_rank_fast}, results
    assert all(err < 1e-5 for _, err in results), results


def disagreeing_rows_first_call(rank, world_size, salt):
    """Every rank valid alone, but M/W differs: a new signature on every rank."""
    try:
        tpfuse.ag_gemm(torch.randn(20 + salt + rank, 6), torch.randn(6, 5))
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("mode", ["on", "off"])
def test_new_signature_mismatch_raises_everywhere_even_without_the_per_call_round(pools, mode):
    """21.5: the first call of a signature is the always-on guard; 21.4: it names the field."""
    pool = pools(mode, 2)
    t0 = time.monotonic()
    messages = pool.run(disagreeing_rows_first_call, 0 if mode == "on" else 7, timeout=JOB_TIMEOUT)
    assert time.monotonic() - t0 < JOB_TIMEOUT
    for msg in messages:
        assert msg is not None and "ranks disagree on M/W (rows of a_shard)" in msg, msg
        assert "strategy" not in msg.split(";")[0], msg  # the real field, not a derived one
        assert "on rank(s) [0]" in msg and "on rank(s) [1]" in msg, msg


def dtype_and_op_mismatch(rank, world_size):
    a, b = torch.randn(8, 6), torch.randn(6, 5)
    try:
        if rank == 0:
            tpfuse.gemm_ar(a, b)
        else:
            tpfuse.gemm_ar(a.bfloat16(), b.bfloat16())
    except ValueError as exc:
        first = str(exc)
    try:
        if rank == 0:
            tpfuse.gemm_ar(a, b, strategy="unfused")
        else:
            tpfuse.gemm_rs(a, b, strategy="unfused")
    except ValueError as exc:
        return first, str(exc)
    return first, None


def test_mismatch_messages_use_the_users_words(pools):
    for first, second in pools("on", 2).run(dtype_and_op_mismatch, timeout=JOB_TIMEOUT):
        assert "dtype (torch.float32 on rank(s) [0], torch.bfloat16 on rank(s) [1])" in first, first
        assert second is not None and "op (gemm_ar on rank(s) [0], gemm_rs on rank(s) [1])" in second, second


# ---------------------------------------------------------------------------------------------
# 21.2 bad input on ONE rank: an error on every rank within seconds, group still usable
# ---------------------------------------------------------------------------------------------

def _one_rank_bad(case, rank, world_size, salt):
    a, b = torch.randn(4 + salt, 6), torch.randn(6, 5)
    bad = rank == world_size - 1
    if case == "return_gathered_int":
        return lambda: tpfuse.ag_gemm(a, b, return_gathered=1 if bad else True)
    if case == "group_string":
        return lambda: tpfuse.gemm_ar(a, b, group="world" if bad else None)
    if case == "meta_tensor":
        return lambda: tpfuse.gemm_ar(a.to("meta") if bad else a, b.to("meta") if bad else b)
    if case == "sparse_a":
        return lambda: tpfuse.gemm_ar(a.to_sparse() if bad else a, b)
    if case == "strategy_not_str":
        return lambda: tpfuse.gemm_rs(a.repeat(world_size, 1), b, strategy=None if bad else "auto")
    if case == "unknown_strategy":
        return lambda: tpfuse.gemm_ar(a, b, strategy="magic" if bad else "ring")
    raise AssertionError(case)


ONE_RANK_CASES = {
    "return_gathered_int": (TypeError, "return_gathered must be a bool"),
    "group_string": (TypeError, "ProcessGroup"),
    "meta_tensor": (ValueError, "meta device"),
    "sparse_a": (ValueError, "dense (strided)"),
    "strategy_not_str": (TypeError, "strategy must be a string"),
    "unknown_strategy": (ValueError, "unknown strategy 'magic'"),
}


def one_rank_bad_input(rank, world_size, case, salt):
    return caught_then_probe(rank, _one_rank_bad(case, rank, world_size, salt))


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("case", sorted(ONE_RANK_CASES))
def test_one_rank_bad_input_raises_on_every_rank(pools, mode, case):
    """With the round off, a new signature still carries the error (the always-on guard); the
    signatures here are fresh per case and mode."""
    world_size = 2
    expected_type, expected_text = ONE_RANK_CASES[case]
    salt = 100 + 2 * sorted(ONE_RANK_CASES).index(case) + (mode == "on")
    pool = pools(mode, world_size)  # started outside the timed part
    t0 = time.monotonic()
    results = pool.run(one_rank_bad_input, case, salt, timeout=JOB_TIMEOUT)
    assert time.monotonic() - t0 < 15, "took too long: someone waited for a timeout"
    for rank, (caught, probe) in enumerate(results):
        assert caught is not None, f"rank {rank}: no error"
        if rank == world_size - 1:
            assert caught[0] == expected_type.__name__ and expected_text in caught[1], caught
        else:
            assert caught[0] == "ValueError" and "invalid input on rank(s) [1]" in caught[1], caught
            assert expected_text in caught[1], caught  # the bad rank's own words travel
        assert probe == sum(range(world_size))


# ---------------------------------------------------------------------------------------------
# 21.3 edge shapes under auto; sparse input on every op
# ---------------------------------------------------------------------------------------------

def empty_dims_under_auto(rank, world_size):
    g = torch.Generator().manual_seed(7)
    out = {}
    # ag_gemm with K = 0 and with N = 0
    for name, (k, n) in {"ag_k0": (0, 5), "ag_n0": (4, 0)}.items():
        a_full = torch.randn(world_size * 3, k, generator=g)
        b = torch.randn(k, n, generator=g)
        c, full = tpfuse.ag_gemm(a_full[rank * 3:(rank + 1) * 3], b, return_gathered=True)
        out[name] = torch.equal(full, a_full) and c.shape == (world_size * 3, n) and torch.allclose(c, a_full @ b)
    # gemm_rs / gemm_ar with N = 0, with K = 0 everywhere, and with K = 0 on rank 0 only (uneven split)
    for name, ks, n in (("n0", (4, 4), 0), ("k0", (0, 0), 5), ("k0_rank0", (0, 6), 5)):
        a_all = [torch.randn(world_size * 2, ks[r % 2], generator=g) for r in range(world_size)]
        bs = [torch.randn(ks[r % 2], n, generator=g) for r in range(world_size)]
        full = sum(x @ y for x, y in zip(a_all, bs))
        rs = tpfuse.gemm_rs(a_all[rank], bs[rank])
        ar = tpfuse.gemm_ar(a_all[rank], bs[rank])
        out["rs_" + name] = rs.shape == (2, n) and torch.allclose(rs, full[rank * 2:(rank + 1) * 2], atol=1e-6)
        out["ar_" + name] = ar.shape == full.shape and torch.allclose(ar, full, atol=1e-6)
    return out


def test_empty_k_and_n_under_auto(pools):
    for rank, result in enumerate(pools("on", 2).run(empty_dims_under_auto, timeout=JOB_TIMEOUT)):
        assert all(result.values()), (rank, result)


def test_planner_accepts_empty_k_and_n():
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        for n, k in ((0, 64), (64, 0)):
            p = tpfuse.plan(op, m=256, n=n, k=k, world_size=4, dtype="bf16", hardware="h200")
            assert p.strategy == "unfused", (op, n, k, p.strategy)


def sparse_on_every_op(rank, world_size):
    a, b = torch.randn(4, 6).to_sparse(), torch.randn(6, 5)
    found = []
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        try:
            getattr(tpfuse, op)(a, b, strategy="unfused")
        except ValueError as exc:
            found.append(f"{op}: a_shard must be a dense" in str(exc) or f"{op}: a must be a dense" in str(exc))
        else:
            found.append(False)
    return found


def test_sparse_a_is_a_clear_error_on_every_op(pools):
    assert all(all(r) for r in pools("on", 2).run(sparse_on_every_op, timeout=JOB_TIMEOUT))


# ---------------------------------------------------------------------------------------------
# 21.4 diagnostics: gemm_ar's reduce phase is labelled gemm_ar; no stale breadcrumbs
# ---------------------------------------------------------------------------------------------

def gemm_ar_hangs_in_its_reduce(rank, world_size):
    a, b = torch.randn(6, 4), torch.randn(4, 3)
    tpfuse.gemm_ar(a, b, strategy="ring")  # together once: the signature is decided
    if rank == 1:
        time.sleep(600)
    tpfuse.gemm_ar(a, b, strategy="ring")


def test_gemm_ar_reduce_phase_is_labelled_gemm_ar():
    env = dict(TEST_RANK_ENV, TPFUSE_DEBUG="0")
    with RankPool(2, env=env) as pool:
        with pytest.raises(TimeoutError) as info:
            pool.run(gemm_ar_hangs_in_its_reduce, timeout=8)
    msg = str(info.value)
    assert "rank 0 last did: 'ring gemm_ar" in msg and "gemm_rs" not in msg, msg


def plan_with_a_real_group(rank, world_size):
    p = tpfuse.plan("ag_gemm", m=64, n=48, k=32, world_size=world_size, dtype="fp32", hardware="cpu-gloo",
                    group=dist.group.WORLD)
    try:
        tpfuse.plan("ag_gemm", m=96, n=48, k=32, world_size=world_size + 1, group=dist.group.WORLD)
    except ValueError as exc:
        wrong = str(exc)
    return p.strategy, sorted(p.predicted_ms), wrong


def test_plan_with_a_real_group_offers_what_the_group_can_run(pools):
    for strategy, predicted, wrong in pools("on", 2).run(plan_with_a_real_group, timeout=JOB_TIMEOUT):
        assert strategy in ("unfused", "ring") and predicted == ["ring", "unfused"], predicted
        assert "world_size: 3 but the group has 2 ranks" in wrong


def bad_group_while_the_other_uses_a_subgroup(rank, world_size):
    sub = dist.new_group([0, 1])  # same members as WORLD, but another group
    t0 = time.monotonic()
    try:
        tpfuse.gemm_ar(torch.randn(4, 3), torch.randn(3, 2), "world" if rank == 1 else sub, strategy="unfused")
    except (TypeError, TimeoutError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None


def test_bad_group_against_a_subgroup_times_out_in_bounded_time():
    """docs/ops.md: a rank that cannot name its group reports over the default group; a peer
    waiting in a subgroup's round gets a TimeoutError after 30 x TPFUSE_TIMEOUT_S, not 30 min."""
    env = dict(TEST_RANK_ENV, TPFUSE_TIMEOUT_S="0.1")
    with RankPool(2, env=env) as pool:
        (kind0, msg0, t0), (kind1, msg1, _) = pool.run(bad_group_while_the_other_uses_a_subgroup, timeout=JOB_TIMEOUT)
    assert kind1 == "TypeError" and "ProcessGroup" in msg1
    assert kind0 == "TimeoutError" and "rank(s) [1]" in msg0 and "TPFUSE_TIMEOUT_S" in msg0, msg0
    assert 2.5 < t0 < 15


def fake_shapes_on_one_rank(rank, world_size):
    from torch._subclasses.fake_tensor import FakeTensorMode

    shape = None
    if rank == 0:  # shape propagation on one rank only: no round, nobody waits
        with FakeTensorMode():
            shape = tuple(tpfuse.gemm_rs(torch.empty(6 * world_size, 5), torch.empty(5, 3)).shape)
    real = tpfuse.gemm_rs(torch.ones(6 * world_size, 5), torch.ones(5, 3))  # the rounds stay in step
    return shape, tuple(real.shape), real.max().item()


def test_fake_tensor_shape_propagation_on_one_rank(pools):
    for mode in ("on", "off"):
        results = pools(mode, 2).run(fake_shapes_on_one_rank, timeout=JOB_TIMEOUT)
        assert results[0][0] == (6, 3) and all(r[1:] == ((6, 3), 10.0) for r in results), results


def layer_bad_input_on_one_rank(rank, world_size, rows):
    """A ColumnParallelLinear call of a new signature where the last rank's input has the wrong
    feature size (a local error, before any round)."""
    layer = tpfuse.nn.ColumnParallelLinear(16, 8, bias=False)
    x = torch.randn(rows, 16 if rank != world_size - 1 else 15)
    t0 = time.monotonic()
    try:
        layer(x)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)[:300], time.monotonic() - t0
    return None, "", time.monotonic() - t0


@pytest.mark.parametrize("mode", ["on", "off"])
def test_layer_bad_input_on_one_rank_raises_on_every_rank_at_once(pools, mode):
    """tpfuse.nn with the per-call round off (the NCCL default): the bad rank posts its error, so
    a peer deciding the new signature raises at once instead of waiting out the round's bound."""
    rows = 6 if mode == "on" else 10   # a fresh signature per mode
    for rank, (kind, text, seconds) in enumerate(pools(mode, 2).run(layer_bad_input_on_one_rank, rows,
                                                                     timeout=JOB_TIMEOUT)):
        assert kind == "ValueError", (rank, kind, text)
        assert seconds < 10, f"rank {rank} waited {seconds:.1f} s: {text}"


@pytest.mark.parametrize("backend, data, setting, expected", [
    ("gloo", "cpu", None, True),      # CPU GEMMs: a store round is cheap next to them
    ("gloo", None, None, True),       # no data device given: the group's rule
    ("gloo", "cuda", None, False),    # the one-GPU bed: ~0.43 ms a round against a ~0.5 ms call
    ("nccl", "cuda", None, False),
    ("gloo", "cuda", "1", True),      # TPFUSE_DEBUG wins either way
    ("nccl", "cuda", "1", True),
    ("gloo", "cpu", "0", False),
])
def test_per_call_round_default_follows_the_data_device(monkeypatch, backend, data, setting, expected):
    from types import SimpleNamespace

    from tpfuse import _checks

    monkeypatch.setattr(_checks, "_debug_setting", lambda: setting)
    ctx = SimpleNamespace(world_size=2, device_type="cuda" if backend == "nccl" else "cpu")
    assert _checks.agreement_enabled(ctx, data) is expected
    assert _checks.agreement_enabled(SimpleNamespace(world_size=1, device_type=ctx.device_type), data) is False
