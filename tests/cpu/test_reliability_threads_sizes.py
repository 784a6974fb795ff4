"""Issue 33: two threads on a group, postings that outlive a rank's failure, one-rank oddities,
sizes refused before allocating, settings and the tuning cache, zero sizes on one rank.

Multi-rank cases run on gloo ranks of one pool (``TPFUSE_TIMEOUT_S=1``: agreement rounds end at
30 s, far beyond what any case may take), batched per job; a case that breaks a group's rounds
runs on a fresh subgroup of its own.  Every job is bounded by a timeout below the process
group's, so a regression fails in seconds instead of hanging.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.spawn import RankPool
from conftest import TEST_RANK_ENV

JOB_TIMEOUT = 60  # s; each job's cases take a few seconds


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, env=dict(TEST_RANK_ENV, TPFUSE_TIMEOUT_S="1")) as p:
        yield p


def _timed(call):
    """(exception type name or None, message or result, seconds)."""
    t0 = time.monotonic()
    try:
        out = call()
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return None, out, time.monotonic() - t0


def _set_timeout(value: str | None) -> None:
    from tpfuse import symm

    if value is None:
        os.environ["TPFUSE_TIMEOUT_S"] = "1"
    else:
        os.environ["TPFUSE_TIMEOUT_S"] = value
    symm.timeout_s.cache_clear()


def _probe(group=None) -> float:
    x = torch.ones(1)
    dist.all_reduce(x, group=group)
    return x.item()


# ---------------------------------------------------------------------------------------------
# 33.1 two threads: one group -> both calls raise, never a wrong number; two groups -> both work
# ---------------------------------------------------------------------------------------------

def _thread_data(rank: int, world_size: int, tid: int, step: int):
    """Thread ``tid``'s operands on ``rank`` (its own M, so that calls of different threads that
    pair up across ranks disagree), and the reference of gemm_ar over every rank's operands."""
    m = 6 + 2 * tid
    parts = []
    for r in range(world_size):
        g = torch.Generator().manual_seed(1000 * tid + 10 * step + r)
        parts.append((torch.randn(m, 5, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g,
                                                                                        dtype=torch.float64)))
    return parts[rank], sum(a @ b for a, b in parts)


def two_threads(rank, world_size, same_group, steps):
    groups = [dist.new_group(list(range(world_size)))]
    if not same_group:
        groups.append(dist.new_group(list(range(world_size))))
    barrier = threading.Barrier(2)
    report = {}

    def work(tid):
        group = groups[0] if same_group else groups[tid]
        wrong, ok, errors = 0, 0, []
        barrier.wait()
        for step in range(steps):
            (a, b), ref = _thread_data(rank, world_size, tid, step)
            try:
                out = tpfuse.gemm_ar(a, b, group, strategy="ring")
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{type(exc).__name__}: {exc}")
                break
            if out.shape == ref.shape and torch.allclose(out, ref, atol=1e-9):
                ok += 1
            else:
                wrong += 1
        report[tid] = (wrong, ok, errors)

    threads = [threading.Thread(target=work, args=(tid,), name=f"worker-{tid}") for tid in (0, 1)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    return report, time.monotonic() - t0, any(t.is_alive() for t in threads)


def test_two_threads_on_one_group_raise_and_never_return_a_wrong_number():
    with RankPool(2, env=dict(TEST_RANK_ENV, TPFUSE_TIMEOUT_S="0.1")) as own:
        results = own.run(two_threads, True, 30, timeout=JOB_TIMEOUT)
    seen_both = False
    for rank, (report, seconds, hung) in enumerate(results):
        assert not hung and seconds < 20, (rank, seconds, report)
        for tid, (wrong, ok, errors) in report.items():
            assert wrong == 0, (rank, tid, report)
            for e in errors:
                if "worker-0" in e and "worker-1" in e and "in flight on the same process group" in e:
                    seen_both = True
    assert seen_both, results


def test_two_threads_on_two_groups_both_work(pool):
    for rank, (report, seconds, hung) in enumerate(pool.run(two_threads, False, 25, timeout=JOB_TIMEOUT)):
        assert not hung and seconds < 30, (rank, seconds)
        assert report == {0: (0, 25, []), 1: (0, 25, [])}, (rank, report)


# ---------------------------------------------------------------------------------------------
# 33.2 a posting that outlives its rank's failure; 33.3 one-rank oddities and mismatched groups
# ---------------------------------------------------------------------------------------------

def _fresh():
    return dist.new_group([0, 1])


def one_rank_failures(rank, world_size):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpfuse import _checks

    out = {}
    a, b = torch.randn(8, 5), torch.randn(5, 3)

    # TPFUSE_TIMEOUT_S bad on one rank only: that rank's round reads it before posting
    g = _fresh()
    if rank == 1:
        _set_timeout("abc")
    out["timeout_setting"] = _timed(lambda: tpfuse.gemm_ar(a, b, g))
    _set_timeout(None)
    out["timeout_setting_after"] = _probe(g)

    # a huge local K on one rank (stride-0 expanded operands take no memory)
    g = _fresh()
    k = 2**40 if rank == 1 else 5
    big_a, big_b = torch.ones(()).expand(8, k), torch.ones(()).expand(k, 3)
    out["huge_local_k"] = _timed(lambda: tpfuse.gemm_rs(big_a, big_b, g, strategy="ring"))
    out["huge_local_k_after"] = _probe(g)

    # a huge local N on one rank (ag_gemm's N is local)
    g = _fresh()
    n = 2**40 if rank == 1 else 3
    out["huge_local_n"] = _timed(lambda: tpfuse.ag_gemm(a, torch.ones(()).expand(5, n), g))

    # TPFUSE_DEBUG different across ranks: ranks would run different numbers of rounds
    g = _fresh()
    os.environ["TPFUSE_DEBUG"] = "1" if rank == 0 else "0"
    _checks._debug_setting.cache_clear()
    out["debug_differs"] = _timed(lambda: tpfuse.gemm_ar(a, b, g))
    os.environ["TPFUSE_DEBUG"] = "1"
    _checks._debug_setting.cache_clear()

    # a strided nested tensor on one rank
    g = _fresh()
    nested = torch.nested.nested_tensor([torch.randn(8, 5)]) if rank == 1 else a
    out["nested"] = _timed(lambda: tpfuse.gemm_ar(nested, b, g))

    # FakeTensors outside FakeTensorMode on one rank
    g = _fresh()
    if rank == 1:
        with FakeTensorMode():
            fa, fb = torch.empty(8, 5), torch.empty(5, 3)
    else:
        fa, fb = a, b
    out["fake_outside_mode"] = _timed(lambda: tpfuse.gemm_ar(fa, fb, g))
    out["fake_after"] = _probe(g)
    return out


def test_one_rank_failures_raise_on_every_rank_at_once(pool):
    results = pool.run(one_rank_failures, timeout=JOB_TIMEOUT)
    expect = {  # case -> (the failing rank's type and text, the peer's text)
        "timeout_setting": ("ValueError", "TPFUSE_TIMEOUT_S='abc'"),
        "huge_local_k": ("ValueError", "of memory"),
        "huge_local_n": ("ValueError", "of memory"),
        "nested": ("ValueError", "nested tensor"),
        "fake_outside_mode": ("ValueError", "FakeTensor outside FakeTensorMode"),
    }
    for case, (kind, text) in expect.items():
        (kind0, msg0, t0), (kind1, msg1, t1) = results[0][case], results[1][case]
        assert kind1 == kind and text in msg1, (case, kind1, msg1)
        assert kind0 == "ValueError" and "invalid input on rank(s) [1]" in msg0 and text in msg0, (case, msg0)
        assert max(t0, t1) < 5, (case, t0, t1)
    for rank in (0, 1):
        kind, msg, seconds = results[rank]["debug_differs"]
        assert kind == "ValueError" and "ranks disagree on TPFUSE_DEBUG" in msg and seconds < 5, (rank, msg)
        assert results[rank]["timeout_setting_after"] == 2.0 and results[rank]["fake_after"] == 2.0
        assert results[rank]["huge_local_k_after"] == 2.0


def late_peer_and_swapped_groups(rank, world_size):
    out = {}
    a, b = torch.randn(8, 5), torch.randn(5, 3)

    # a peer later than the round's bound (TPFUSE_TIMEOUT_S=0.1: 3 s): the waiting rank raises
    # TimeoutError, and the late one must not pass the round on the stale posting
    g = _fresh()
    _set_timeout("0.1")
    if rank == 1:
        time.sleep(4.5)
    out["late"] = _timed(lambda: tpfuse.gemm_ar(a, b, g, strategy="ring"))
    _set_timeout(None)

    # groups of the same members, swapped between ranks, then retried
    g1, g2 = _fresh(), _fresh()
    first, second = (g1, g2) if rank == 0 else (g2, g1)
    out["swapped"] = _timed(lambda: tpfuse.gemm_ar(a, b, first, strategy="ring"))
    out["swapped_retry"] = _timed(lambda: tpfuse.gemm_ar(a, b, second, strategy="ring"))
    out["probe"] = _probe()
    return out


def test_late_peer_swapped_and_mismatched_groups_raise_in_bounded_time(pool):
    r0, r1 = pool.run(late_peer_and_swapped_groups, timeout=JOB_TIMEOUT)
    kind, msg, seconds = r0["late"]
    assert kind == "TimeoutError" and "rank(s) [1]" in msg and 2.5 < seconds < 6, r0["late"]
    kind, msg, seconds = r1["late"]
    assert kind == "RuntimeError" and "left this agreement round" in msg and seconds < 2, r1["late"]
    for r in (r0, r1):
        for case in ("swapped",):
            kind, msg, seconds = r[case]
            assert kind == "ValueError" and "different process groups" in msg and seconds < 8, (case, r[case])
        kind, msg, seconds = r["swapped_retry"]
        # the retry ends at once (no wait for the bound), naming the mismatch or the broken rounds
        assert kind in ("ValueError", "RuntimeError") and seconds < 2, r["swapped_retry"]
        assert "different process groups" in msg or "out of step" in msg, msg
        assert r["probe"] == 2.0


def corrupt_cache_entry_on_one_rank(rank, world_size, root):
    """A tuning-cache entry for the call's exact shape that is not what record_measurement
    writes, on one rank: ignored with a warning that names the file; the call is right."""
    from tpfuse import tuning
    from tpfuse.plan import record_measurement

    os.environ["TPFUSE_CACHE_DIR"] = os.path.join(root, f"rank{rank}")
    try:
        m, n, k = 8, 3, 5
        record_measurement("gemm_ar", m=m, n=n, k=k, world_size=world_size, dtype="fp32", hardware="cpu-gloo",
                           strategy="ring", ms=1.0)
        if rank == 1:
            path = tuning.tuning_cache_path()
            data = json.loads(path.read_text())
            for entry in data["entries"].values():
                entry["measured"] = {"ring": ["abc"]}
            path.write_text(json.dumps(data))
            tuning.CACHE._path = None  # reload
        g = torch.Generator().manual_seed(rank)
        a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = _timed(lambda: tpfuse.gemm_ar(a, b))
        parts = [torch.zeros(m, n) for _ in range(world_size)]
        dist.all_gather(parts, a @ b)
        ok = out[0] is None and torch.allclose(out[1], sum(parts), atol=1e-5)
        return ok, out[2], [str(w.message) for w in caught if "tuning cache" in str(w.message)]
    finally:
        os.environ.pop("TPFUSE_CACHE_DIR")


def test_corrupt_cache_entry_on_one_rank_is_ignored_with_a_warning(pool, tmp_path):
    (ok0, s0, w0), (ok1, s1, w1) = pool.run(corrupt_cache_entry_on_one_rank, str(tmp_path), timeout=JOB_TIMEOUT)
    assert ok0 and ok1 and max(s0, s1) < 5
    assert w0 == [] and len(w1) == 1 and str(tmp_path / "rank1" / "tuning.json") in w1[0], w1
    assert "can be deleted" in w1[0]


# ---------------------------------------------------------------------------------------------
# 33.4 sizes refused before allocating, on every rank; 33.9 zero sizes on one rank
# ---------------------------------------------------------------------------------------------

def oversize_everywhere(rank, world_size):
    out = {}
    huge = 2**40
    one = torch.ones(())
    out["m_2e40"] = _timed(lambda: tpfuse.gemm_ar(one.expand(huge, 4), one.expand(4, 3), strategy="unfused"))
    out["k_2e40"] = _timed(lambda: tpfuse.gemm_rs(one.expand(8, huge), one.expand(huge, 3), strategy="ring"))
    out["n_2e40"] = _timed(lambda: tpfuse.ag_gemm(one.expand(4, 4), one.expand(4, huge)))
    out["mw_2e62"] = _timed(lambda: tpfuse.ag_gemm(one.expand(2**62, 1), one.expand(1, 3)))
    out["probe"] = _probe()
    return out


def test_oversize_inputs_are_refused_before_allocating(pool):
    for rank, out in enumerate(pool.run(oversize_everywhere, timeout=JOB_TIMEOUT)):
        for case in ("m_2e40", "k_2e40", "n_2e40"):
            kind, msg, seconds = out[case]
            assert kind == "ValueError" and "GiB of memory" in msg and "cpu" in msg and seconds < 5, (rank, case, msg)
        kind, msg, _ = out["mw_2e62"]
        assert kind == "ValueError" and "overflows int64" in msg, (rank, msg)
        assert out["probe"] == 2.0


def zero_sizes_on_one_rank(rank, world_size):
    g = torch.Generator().manual_seed(3)
    ks = [5, 0]
    a_all = [torch.randn(4, ks[r], generator=g, dtype=torch.float64) for r in range(world_size)]
    b_all = [torch.randn(ks[r], 3, generator=g, dtype=torch.float64) for r in range(world_size)]
    full = sum(x @ y for x, y in zip(a_all, b_all))
    rs = tpfuse.gemm_rs(a_all[rank], b_all[rank])
    ar = tpfuse.gemm_ar(a_all[rank], b_all[rank])
    a_full = torch.randn(4, 6, generator=g, dtype=torch.float64)
    b_ag = torch.randn(6, 3 if rank == 0 else 0, generator=g, dtype=torch.float64)
    c = tpfuse.ag_gemm(a_full[rank * 2:(rank + 1) * 2], b_ag)
    return (torch.equal(rs, full[rank * 2:(rank + 1) * 2]) or torch.allclose(rs, full[rank * 2:(rank + 1) * 2]),
            torch.allclose(ar, full), c.shape == (4, b_ag.shape[1]) and torch.allclose(c, a_full @ b_ag))


def test_zero_sizes_on_one_rank_give_the_right_answer(pool):
    assert pool.run(zero_sizes_on_one_rank, timeout=JOB_TIMEOUT) == [(True, True, True)] * 2


# ---------------------------------------------------------------------------------------------
# 33.5 settings and the tuning cache (no ranks)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", ["inf", "1e308", "-inf", "nan", "0", "abc", "86401"])
def test_timeout_setting_out_of_range_is_a_value_error(raw):
    from tpfuse._settings import parse_timeout_s

    with pytest.raises(ValueError, match=f"TPFUSE_TIMEOUT_S={raw!r}"):
        parse_timeout_s(raw)
    assert parse_timeout_s("86400") == 86400.0 and parse_timeout_s(None) == 10.0


def test_corrupt_entry_is_ignored_with_a_warning_naming_the_file(tmp_path, monkeypatch):
    from tpfuse import tuning
    from tpfuse.plan import choose, record_measurement

    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path))
    args = dict(m=4096, n=7168, k=8192, world_size=8, dtype="bf16", hardware="h200")
    record_measurement("ag_gemm", strategy="fused", ms=0.5, **args)
    path = tuning.tuning_cache_path()
    data = json.loads(path.read_text())
    (key,) = data["entries"]
    for bad in ("a string", {"measured": {"fused": "abc"}}, {"measured": {"fused": [float("nan")]}}, {"x": 1}):
        data["entries"][key] = bad
        path.write_text(json.dumps(data))
        fresh = tuning.TuningCache()
        fresh.current()
        with pytest.warns(RuntimeWarning, match="tuning cache .*tuning.json.*can be deleted"):
            assert fresh.measured(key) == {}
    monkeypatch.setattr(tuning, "CACHE", tuning.TuningCache())
    monkeypatch.setattr(sys.modules["tpfuse.plan"], "_CACHE", tuning.CACHE)
    with pytest.warns(RuntimeWarning, match="can be deleted"):
        p = choose("ag_gemm", **args, candidates=("unfused", "fused"))
    assert p.measured == ()
    record_measurement("ag_gemm", strategy="fused", ms=0.25, **args)  # replaces the corrupt entry
    assert choose("ag_gemm", **args, candidates=("unfused", "fused")).predicted_ms["fused"] == 0.25


def test_tuning_module_is_below_the_planner():
    import ast
    import inspect

    from tpfuse import tuning

    tree = ast.parse(inspect.getsource(tuning))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(name and name.startswith("tpfuse") for name in imported), imported


# ---------------------------------------------------------------------------------------------
# 33.1 the thread guard itself (no ranks): nested calls on one thread are allowed
# ---------------------------------------------------------------------------------------------

def test_thread_guard_names_both_calls_and_fails_the_one_in_flight():
    from tpfuse._dist import enter_call, leave_call

    class Group:  # hashable, like a ProcessGroup
        group_name = "g7"

    group = Group()
    token = enter_call(group, "gemm_rs")
    assert token is group and enter_call(group, "ag_gemm") is None  # nested on this thread
    caught = []

    def other():
        try:
            enter_call(group, "gemm_ar")
        except RuntimeError as exc:
            caught.append(str(exc))

    t = threading.Thread(target=other, name="second")
    t.start()
    t.join()
    assert len(caught) == 1 and "gemm_ar was called from thread 'second'" in caught[0]
    assert "while gemm_rs was in flight" in caught[0] and "'MainThread'" in caught[0] and "'g7'" in caught[0]
    with pytest.raises(RuntimeError, match="gemm_rs: its result is discarded"):
        leave_call(token)
    assert enter_call(group, "gemm_rs") is group  # the group is free again
    leave_call(group)


# ---------------------------------------------------------------------------------------------
# Last in this file: it leaves WORLD's agreement rounds broken on rank 0 (the pool is shared)
# ---------------------------------------------------------------------------------------------

def world_against_a_subgroup(rank, world_size):
    a, b = torch.randn(8, 5), torch.randn(5, 3)
    sub = _fresh()
    out = _timed(lambda: tpfuse.gemm_ar(a, b, None if rank == 0 else sub, strategy="unfused"))
    return out, _probe()


def test_world_against_a_subgroup_of_the_same_members_raises_within_seconds(pool):
    for rank, ((kind, msg, seconds), probe) in enumerate(pool.run(world_against_a_subgroup, timeout=JOB_TIMEOUT)):
        assert kind == "ValueError" and "different process groups" in msg and seconds < 8, (rank, kind, msg)
        assert probe == 2.0


def layer_init_fails_on_one_rank(rank, world_size):
    from tpfuse.nn import ColumnParallelLinear

    g = _fresh()
    if rank == 1:
        out = _timed(lambda: ColumnParallelLinear(0, 4, bias=False, group=g, strategy="unfused"))
    else:
        layer = ColumnParallelLinear(6, 4, bias=False, group=g, strategy="unfused")
        out = _timed(lambda: layer(torch.randn(3, 6)))
    return {"init": out, "probe": _probe(g)}


def test_a_layer_whose_init_fails_on_one_rank_makes_the_peers_first_call_raise(pool):
    r0, r1 = pool.run(layer_init_fails_on_one_rank, timeout=JOB_TIMEOUT)
    kind, msg, seconds = r1["init"]
    assert kind == "ValueError" and "in_features" in msg, r1
    kind, msg, seconds = r0["init"]
    assert kind == "ValueError" and "rank(s) [1]" in msg and "in_features" in msg and seconds < 5, r0
    assert r0["probe"] == r1["probe"] == 2.0

