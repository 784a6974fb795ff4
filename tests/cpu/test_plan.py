"""The planner: Plan fields, decisions, validation, the tuning cache, and the `tpfuse plan` CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings

import pytest
import torch

from tpfuse import dtypes, strategies
from tpfuse.bench.workloads import workload_matrix
from tpfuse.model import cost
from tpfuse.model.hardware import get_profile
from tpfuse.plan import Plan, canonical_dtype, choose, plan, record_measurement, tuning_cache_path
from tpfuse.report import add_plan_arguments, run_plan_cli

# the strategies with a schedule (every one of ours; sm_workers declares AUTO = False)
STRATEGIES = tuple(s for s in strategies.names() if strategies.info(s).schedule is not None)

SHAPE = dict(m=16384, n=7168, k=8192)  # Llama-3 70B fc1, training, TP 8


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path / "cache"))


ALL = tuple(STRATEGIES)  # plan() predicts every one of them


def test_plan_fields():
    p = choose("ag_gemm", **SHAPE, world_size=8, dtype="bf16", hardware="h200", candidates=ALL)
    assert isinstance(p, Plan) and p.op == "ag_gemm"
    assert set(p.predicted_ms) == set(STRATEGIES)
    assert p.strategy in STRATEGIES and p.predicted_ms[p.strategy] == min(p.predicted_ms.values())
    assert p.num_chunks == p.chunks[p.strategy] >= 1
    assert {"gemm_ms", "comm_ms", "fill_ms", "drain_ms"} <= set(p.breakdown)
    assert p.breakdown["gemm_ms"] == pytest.approx(cost.gemm_time_ms(16384, 7168, 8192, "bf16", get_profile("h200")))
    assert p.breakdown["comm_ms"] > 0
    assert p.strategy in p.explain() and "unfused" in p.explain()
    assert p.speedup > 1  # a training-sized GEMM on NVLink hides its all-gather
    json.dumps(p.to_dict())


def test_breakdown_is_strategy_independent():
    p = plan("gemm_rs", m=4096, n=8192, k=3584, world_size=8, dtype="bf16")
    q = choose("gemm_rs", m=4096, n=8192, k=3584, world_size=8, dtype="bf16", hardware="h200",
               candidates=("unfused",))
    assert q.strategy == "unfused"
    assert (p.breakdown["gemm_ms"], p.breakdown["comm_ms"]) == (q.breakdown["gemm_ms"], q.breakdown["comm_ms"])


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
def test_world_size_one_is_unfused_without_comm(op):
    p = plan(op, m=4096, n=4096, k=4096, world_size=1, dtype=torch.bfloat16)
    assert p.strategy == "unfused" and p.breakdown["comm_ms"] == 0.0
    assert "world_size is 1" in p.explain()
    c = choose(op, m=4096, n=4096, k=4096, world_size=1, dtype="bf16", hardware="h200",
               candidates=("unfused", "ring", "fused"))
    assert c.strategy == "unfused"


def test_dtype_spellings_agree():
    assert canonical_dtype(torch.bfloat16) == canonical_dtype("bfloat16") == canonical_dtype("bf16") == "bf16"
    assert canonical_dtype(torch.float64) == canonical_dtype("fp64") == "fp64"
    a = plan("gemm_ar", m=128, n=8192, k=3584, world_size=8, dtype=torch.bfloat16)
    b = plan("gemm_ar", m=128, n=8192, k=3584, world_size=8, dtype="bf16")
    assert a == b and dict(a.predicted_ms) == dict(b.predicted_ms)


@pytest.mark.parametrize("kwargs, match", [
    (dict(op="allgather"), "op: unknown op 'allgather'"),
    (dict(dtype="int8"), "dtype: 'int8' is not supported"),
    (dict(hardware="tpu"), "hardware: unknown profile 'tpu'"),
    (dict(m=-1), "m: -1 must be >= 0"),
    (dict(n=-1), "n: -1 must be >= 0"),
    (dict(world_size=0), "world_size: 0 must be >= 1"),
])
def test_validation_names_arg_value_fix(kwargs, match):
    args = dict(op="ag_gemm", m=4096, n=1024, k=1024, world_size=4, dtype="bf16", hardware="h200")
    args.update(kwargs)
    op = args.pop("op")
    with pytest.raises(ValueError, match=match):
        plan(op, **args)


def test_m_must_be_int():
    with pytest.raises(TypeError, match="m: expected an int"):
        plan("ag_gemm", m=4096.0, n=8, k=8, world_size=2)


def test_empty_m_is_legal():
    p = plan("ag_gemm", m=0, n=1024, k=1024, world_size=4)
    assert p.breakdown["comm_ms"] == 0.0 and p.predicted_ms["unfused"] >= 0


def test_deterministic_and_fast_on_repeat():
    a = plan("gemm_rs", m=16384, n=8192, k=3584, world_size=8)
    assert a == plan("gemm_rs", m=16384, n=8192, k=3584, world_size=8)
    args = dict(m=16384, n=8192, k=3584, world_size=8, dtype=torch.bfloat16, hardware="h200",
                candidates=("unfused", "ring", "copy_engine", "fused"))
    first = choose("gemm_rs", **args)
    t0 = time.perf_counter()
    for _ in range(1000):
        assert choose("gemm_rs", **args) is first
    assert time.perf_counter() - t0 < 0.5


def test_choose_respects_candidates():
    p = choose("ag_gemm", **SHAPE, world_size=8, dtype="bf16", hardware="h200", candidates=("ring",))
    assert set(p.predicted_ms) == {"unfused", "ring"} and p.strategy in ("unfused", "ring")
    with pytest.raises(ValueError, match="candidates: unknown strategies"):
        choose("ag_gemm", **SHAPE, world_size=8, dtype="bf16", hardware="h200", candidates=("warp",))


def test_never_beats_its_parts():
    """No strategy is predicted faster than max(GEMM alone, collective alone) -- nor than the
    collective's bytes over the link's line rate."""
    hw = get_profile("h200")
    for cell in workload_matrix(world_sizes=(2, 8), phases=("training", "decode")):
        p = plan(cell.op, m=cell.m, n=cell.n, k=cell.k, world_size=cell.world_size, dtype=cell.dtype)
        elt = dtypes.itemsize("bf16")
        w = cell.world_size
        moved = {"ag_gemm": cell.m * cell.k * elt * (w - 1) / w, "gemm_rs": cell.m * cell.n * elt * (w - 1) / w,
                 "gemm_ar": 2 * cell.m * cell.n * elt * (w - 1) / w}[cell.op]
        assert p.breakdown["comm_ms"] >= moved / (hw.link_line_gbps * 1e9) * 1e3
        floor = max(p.breakdown["gemm_ms"], p.breakdown["comm_ms"])
        for s, ms in p.predicted_ms.items():
            assert ms >= floor * (1 - 1e-9), (cell.name, s, ms, floor)


@pytest.mark.parametrize("field", ["link", "flops"])
def test_more_bandwidth_or_flops_never_slower(field):
    base = get_profile("h200")
    if field == "link":
        better = dataclasses.replace(base, link_nccl_gbps=2 * base.link_nccl_gbps, link_ce_gbps=2 * base.link_ce_gbps,
                                     link_sm_max_gbps=2 * base.link_sm_max_gbps,
                                     link_sm_gbps_per_sm=2 * base.link_sm_gbps_per_sm,
                                     nccl_measured=tuple(dataclasses.replace(f, bus_gbps=2 * f.bus_gbps)
                                                         for f in base.nccl_measured))
        assert base.nccl_fit(2) is not None  # the measured W=2 table is exercised too
    else:
        better = dataclasses.replace(base, tflops_bf16=2 * base.tflops_bf16)
    for cell in workload_matrix(world_sizes=(2, 8), models=("8b", "70b")):
        p = plan(cell.op, m=cell.m, n=cell.n, k=cell.k, world_size=cell.world_size, hardware=base)
        q = plan(cell.op, m=cell.m, n=cell.n, k=cell.k, world_size=cell.world_size, hardware=better)
        for s in STRATEGIES:
            assert q.predicted_ms[s] <= p.predicted_ms[s] * (1 + 1e-9), (cell.name, s)


def test_decode_gains_less_than_training():
    def speedup(phase):
        (fc1,) = [c for c in workload_matrix(world_sizes=(8,), models=("70b",), phases=(phase,)) if c.gemm == "fc1"]
        return choose(fc1.op, m=fc1.m, n=fc1.n, k=fc1.k, world_size=8, dtype="bf16", hardware="h200",
                      candidates=ALL).speedup
    # against the stock baseline (NCCL + one GEMM): decode's small GEMM hides little communication
    assert speedup("decode") < speedup("training")


def test_cpu_gloo_profile_plans():
    p = plan("ag_gemm", m=64, n=48, k=32, world_size=2, dtype="fp32", hardware="cpu-gloo")
    assert p.strategy in STRATEGIES
    c = choose("ag_gemm", m=64, n=48, k=32, world_size=2, dtype="fp32", hardware="cpu-gloo",
               candidates=("unfused", "ring"))
    assert c.strategy == min(("unfused", "ring"), key=lambda s: c.predicted_ms[s])


# --- tuning cache -------------------------------------------------------------------------------
def test_measurement_overrides_model():
    args = dict(m=16384, n=7168, k=8192, world_size=8, dtype="bf16", hardware="h200")
    cands = ("unfused", "ring", "copy_engine", "fused")
    before = choose("ag_gemm", **args, candidates=cands)
    assert before.strategy != "unfused" and before.measured == ()
    record_measurement("ag_gemm", strategy="unfused", ms=0.001, **args)
    after = choose("ag_gemm", **args, candidates=cands)
    assert after.strategy == "unfused" and after.measured == ("unfused",)
    assert after.predicted_ms["unfused"] == 0.001 and "measured" in after.explain()
    data = json.loads(tuning_cache_path().read_text())
    (entry,) = data["entries"].values()
    assert entry["measured"] == {"unfused": [0.001]} and entry["world_size"] == 8
    (key,) = data["entries"]
    assert "torch=" in key and "triton=" in key and "tpfuse=" in key and "h200" in key
    with pytest.raises(ValueError, match="ms: -1 must be a positive"):
        record_measurement("ag_gemm", strategy="fused", ms=-1, **args)


def test_a_strategy_declaring_auto_false_is_predicted_but_chosen_only_on_a_measurement():
    """AUTO = False (sm_workers: its worker bandwidth is a lead until the GPU runs): plan() and
    choose() list its prediction, never choose it on the model alone -- even predicted far the
    fastest, and the reason says so -- and choose it once a measured time makes it fastest."""
    import types

    from tpfuse.model.simulate import Schedule

    def instant(g, c):
        for r in g.ranks:
            g.add(r, "gemm", "gemm", 1e-6, label="GEMM")

    toy = types.SimpleNamespace(NAME="toy_unchecked", DESCRIPTION="a model nobody measured", DTYPES=dtypes.EVERY,
                                why_unavailable=lambda *a: None, ag_gemm=print, gemm_rs=print, gemm_ar=print,
                                SCHEDULE=Schedule(instant, kind="pipeline"), AUTO=False)
    strategies.register(toy)
    try:
        args = dict(m=16384, n=7168, k=8192, world_size=8, dtype="bf16", hardware="h200")
        p = plan("ag_gemm", **args)
        assert p.predicted_ms["toy_unchecked"] < min(v for s, v in p.predicted_ms.items() if s != "toy_unchecked")
        assert p.strategy != "toy_unchecked" and "toy_unchecked is predicted faster" in p.reason
        assert "AUTO = False" in p.reason and "record_measurement" in p.reason
        cands = ("unfused", "fused", "toy_unchecked")
        assert choose("ag_gemm", **args, candidates=cands).strategy == "fused"
        record_measurement("ag_gemm", strategy="toy_unchecked", ms=0.01, **args)
        after = choose("ag_gemm", **args, candidates=cands)
        assert after.strategy == "toy_unchecked" and "is predicted faster" not in after.reason
    finally:
        strategies.unregister("toy_unchecked")
    assert not strategies.info("sm_workers").auto
    for op, m in (("ag_gemm", 16384), ("gemm_rs", 16384), ("gemm_ar", 128), ("gemm_ar", 4096)):
        p = plan(op, m=m, n=4096, k=1024, world_size=4, dtype="bf16", hardware="h200")
        assert "sm_workers" in p.predicted_ms and p.strategy != "sm_workers"


def test_corrupt_cache_is_empty_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path / "corrupt"))
    path = tuning_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text('{"entries": {broken')
    args = dict(m=4096, n=7168, k=8192, world_size=8, dtype="bf16", hardware="h200",
                candidates=("unfused", "fused"))
    with pytest.warns(RuntimeWarning, match="tuning cache .* is unreadable"):
        p = choose("ag_gemm", **args)
    assert p.measured == ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choose("ag_gemm", **dict(args, m=8192))  # no second warning
    record_measurement("ag_gemm", m=4096, n=7168, k=8192, world_size=8, dtype="bf16", hardware="h200",
                       strategy="fused", ms=0.5)
    assert json.loads(path.read_text())["version"] == 1  # rewritten whole, atomically
    assert choose("ag_gemm", **args).predicted_ms["fused"] == 0.5


# --- CLI ----------------------------------------------------------------------------------------
def _run(argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return run_plan_cli(parser.parse_args(argv))


def test_cli_one_cell_table(capsys):
    assert _run(["--op", "gemm_rs", "--m", "16384", "--n", "8192", "--k", "3584", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    p = plan("gemm_rs", m=16384, n=8192, k=3584, world_size=8)
    assert "PREDICTED" in out and p.strategy in out and f"{p.speedup:.2f}x" in out and "Why:" in out


def test_cli_matrix_and_json(capsys):
    assert _run(["--hardware", "h200", "--model", "8b", "--phase", "decode"]) == 0
    out = capsys.readouterr().out
    for w in (2, 4, 8):
        assert f"8b-decode-fc1-tp{w}" in out and f"8b-decode-fc2-tp{w}" in out
    assert _run(["--hardware", "gb200", "--model", "70b", "--phase", "decode", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted({r["world_size"] for r in rows}) == [8, 16, 32, 72]
    assert all(r["strategy"] in STRATEGIES for r in rows)


def test_cli_timeline_png(tmp_path, capsys):
    out = tmp_path / "tl.png"
    assert _run(["--op", "ag_gemm", "--m", "4096", "--n", "7168", "--k", "8192", "--world-size", "4",
                 "--timeline", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and str(out) in capsys.readouterr().out


def test_cli_partial_cell_is_an_error(capsys):
    assert _run(["--op", "ag_gemm", "--m", "4096"]) == 2
    assert "needs --op, --m, --n, --k and --world-size" in capsys.readouterr().err


def test_model_only_win_needs_a_margin():
    """When ring is predicted faster than unfused by less than MIN_MODEL_GAIN, unfused is kept on
    the model alone and the reason says why (on 2x H200, ring predicted level with unfused ran up
    to 7% slower -- BENCHMARKS.md).  Measured times for both from the tuning cache decide as they
    are.  The case is searched for (ring's host-step cost swept on the h200 profile), so the test
    does not hang on today's calibrated numbers."""
    from tpfuse.plan import MIN_MODEL_GAIN
    cands = ("unfused", "ring")
    found = None
    for cell in workload_matrix(world_sizes=(2, 4, 8), phases=("training", "prefill")):
        for host_us in (0.0, 20.0, 60.0, 120.0, 250.0):
            hw = dataclasses.replace(get_profile("h200"), ring_step_host_us=host_us)
            p = choose(cell.op, m=cell.m, n=cell.n, k=cell.k, world_size=cell.world_size, dtype="bf16",
                       hardware=hw, candidates=cands)
            gain = 1 - p.predicted_ms["ring"] / p.predicted_ms["unfused"]
            if 0 < gain < MIN_MODEL_GAIN:
                found = (cell, hw, p)
                break
        if found:
            break
    assert found, "no cell predicts ring a little faster than unfused; widen the sweep"
    cell, hw, p = found
    assert p.strategy == "unfused" and "margin" in p.explain()
    args = dict(m=cell.m, n=cell.n, k=cell.k, world_size=cell.world_size, dtype="bf16", hardware=hw)
    record_measurement(cell.op, strategy="unfused", ms=3.0, **args)
    record_measurement(cell.op, strategy="ring", ms=2.95, **args)
    q = choose(cell.op, **args, candidates=cands)
    assert q.strategy == "ring" and set(q.measured) == {"unfused", "ring"}
    # a clear model-only win is still taken
    big = choose("gemm_rs", m=16384, n=4096, k=1792, world_size=8, dtype="bf16", hardware="h200", candidates=ALL)
    assert big.strategy != "unfused"
    assert big.predicted_ms[big.strategy] <= big.predicted_ms["unfused"] * (1 - MIN_MODEL_GAIN)


# --- issue 22.6: the planner only recommends what runs, and its text adds up ----------------------
def _cells_everywhere():
    for hw, sizes in (("h200", (2, 4, 8)), ("gb200", (8, 72))):
        for cell in workload_matrix(world_sizes=sizes):
            yield hw, cell


def test_plan_predicts_every_registered_strategy():
    for hw, cell in _cells_everywhere():
        p = plan(cell.op, m=cell.m, n=cell.n, k=cell.k, world_size=cell.world_size, dtype=cell.dtype,
                 hardware=hw)
        assert p.strategy in STRATEGIES and set(p.predicted_ms) <= set(STRATEGIES), (hw, cell.name, p.strategy)
        assert not hasattr(p, "modelled_ms")
    # the README's example
    assert plan("ag_gemm", m=16384, n=7168, k=8192, world_size=8, dtype="bf16", hardware="h200").strategy in STRATEGIES


def test_cli_table_comes_from_the_report_module(capsys):
    import sys

    planner = sys.modules["tpfuse.plan"]   # the attribute tpfuse.plan is the function
    assert hasattr(planner, "choose") and not hasattr(planner, "run_plan_cli")
    assert not hasattr(planner, "_print_table") and not hasattr(planner, "argparse")
    assert _run(["--op", "gemm_rs", "--m", "16384", "--n", "8192", "--k", "3584", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "chose '" in out and "Candidates: " in out and "modelled" not in out.lower()


@pytest.mark.parametrize("graph", [False, True])
def test_explanation_obeys_its_own_arithmetic(graph):
    """Would catch "hides 1.3903 ms of the 0.6558 ms collective" (gemm_rs 16384x8192x3584, W = 8)
    and "hides 0.0643 ms of the 0.0142 ms collective" (gemm_ar decode): hidden <= collective, and
    fill + steady + drain = predicted, for every cell, every candidate set."""
    import re

    cells = [(hw, c.op, c.m, c.n, c.k, c.world_size) for hw, c in _cells_everywhere()]
    cells += [("h200", "gemm_rs", 16384, 8192, 3584, 8), ("h200", "gemm_ar", 128, 8192, 3584, 8)]
    for hw, op, m, n, k, w in cells:
        for cands in (ALL, ("unfused", "ring")):
            p = choose(op, m=m, n=n, k=k, world_size=w, dtype="bf16", hardware=hw, candidates=cands,
                       cuda_graph=graph)
            b = p.breakdown
            assert b["fill_ms"] + b["steady_ms"] + b["drain_ms"] == pytest.approx(b["model_ms"], abs=1e-9)
            assert b["model_ms"] == pytest.approx(p.predicted_ms[p.strategy])
            text = p.explain()
            for hidden, coll in re.findall(r"hides ([0-9.]+) ms of the ([0-9.]+) ms collective", text):
                assert float(hidden) <= float(coll), (hw, op, m, n, k, w, text)
            sums = re.search(r"fill ([0-9.]+) \+ steady ([0-9.]+) \+ drain ([0-9.]+) = ([0-9.]+) ms", text)
            assert sums and sum(map(float, sums.groups()[:3])) == pytest.approx(float(sums.group(4)), abs=2e-4)
            assert f"{p.predicted_ms[p.strategy]:.4f} ms" in text


def test_same_host_model_for_every_strategy_and_graphs_drop_it():
    """Eager: every strategy pays tpfuse's dispatch and its launches; a CUDA graph pays none, so the
    decode speedup of an overlapped strategy is not an artifact of unfused's host time alone."""
    hw = get_profile("h200")
    for op, m, n, k in (("gemm_ar", 128, 8192, 3584), ("gemm_rs", 16384, 8192, 3584), ("ag_gemm", 128, 7168, 8192)):
        eager = choose(op, m=m, n=n, k=k, world_size=8, dtype="bf16", hardware=hw, candidates=ALL)
        graph = choose(op, m=m, n=n, k=k, world_size=8, dtype="bf16", hardware=hw, candidates=ALL, cuda_graph=True)
        for s in ALL:   # the host runs ahead of the GPU: eager costs at least the graph replay
            assert eager.predicted_ms[s] >= graph.predicted_ms[s] - 1e-9, (op, s)
        if m == 128:    # decode: host-bound, so eager pays at least tpfuse's dispatch and one launch
            assert min(eager.predicted_ms.values()) >= (hw.host_op_us + hw.host_call_us) * 1e-3
        assert "eager" in eager.explain() and "CUDA graph" in graph.explain()
    assert plan("gemm_ar", m=128, n=8192, k=3584, world_size=8, cuda_graph=True).cuda_graph


def test_float64_never_plans_a_strategy_that_cannot_run_it():
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        p = choose(op, m=16384, n=7168, k=8192, world_size=8, dtype="fp64", hardware="h200", candidates=ALL)
        assert p.strategy in ("unfused", "ring") and set(p.predicted_ms) <= {"unfused", "ring"}
        q = plan(op, m=16384, n=7168, k=8192, world_size=8, dtype=torch.float64)
        assert set(q.predicted_ms) == {"unfused", "ring"}


def test_beyond_the_nvlink_domain_plans_multi_node():
    p = choose("ag_gemm", m=16384, n=7168, k=8192, world_size=16, dtype="bf16", hardware="h200", candidates=ALL)
    assert set(p.predicted_ms) <= {"unfused", "ring"} and "spans hosts" in p.explain()
    inside = choose("ag_gemm", m=16384, n=7168 * 2, k=8192, world_size=8, dtype="bf16", hardware="h200",
                    candidates=ALL)
    assert "copy_engine" in inside.predicted_ms
    # the network is slower than NVLink: the same per-rank collective costs more across hosts
    assert p.breakdown["comm_ms"] > inside.breakdown["comm_ms"]


def test_plan_is_fast_at_nvl72_scale():
    from tpfuse.plan import _best_per_strategy

    _best_per_strategy.cache_clear()
    times = []
    for cell in workload_matrix(world_sizes=(72,)):
        t0 = time.perf_counter()
        plan(cell.op, m=cell.m, n=cell.n, k=cell.k, world_size=72, dtype="bf16", hardware="gb200")
        times.append(time.perf_counter() - t0)
    times.sort()
    assert times[len(times) // 2] < 0.05, times  # median < 50 ms (a shared 2-core box; ~7 ms alone)
    # the slowest single plan: far below the ~6 s a plan once took at W = 72; one call can stall
    # on a shared 2-core box (0.27 s seen once in CI), so the bound is not tighter
    assert times[-1] < 1.0, times


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "--world-size: 0 must be >= 1"),
    (["--all", "--op", "ag_gemm"], "--all plans the whole workload matrix and ignores --op"),
    (["--hardware", "foo"], "unknown profile 'foo'"),
])
def test_cli_argument_errors_are_one_line_exit_2(capsys, argv, message):
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cli_timeline_without_matplotlib_is_an_error(capsys, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert _run(["--op", "ag_gemm", "--m", "4096", "--n", "7168", "--k", "8192", "--world-size", "4",
                 "--timeline", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "--timeline needs matplotlib" in err and err.count("\n") == 1, err


# --- issues 20.4 / 22.6: fused's pieces per rank come from the knob fused dispatches with ---------
@pytest.mark.parametrize("graph", [False, True])
def test_plan_predicts_fused_with_the_knobs_pieces(graph):
    from tpfuse.strategies import fused

    hw = get_profile("h200")
    cells = [(c.m, c.n, c.k, c.world_size) for c in workload_matrix(world_sizes=(2, 8), models=("8b", "70b"))
             if c.op == "ag_gemm"] + [(16384, 1536, 8192, 8)]
    seen = set()
    for m, n, k, w in cells:
        p = plan("ag_gemm", m=m, n=n, k=k, world_size=w, dtype="bf16", hardware=hw, cuda_graph=graph)
        c = fused.planned_chunks_per_rank(m // w, n, k, w, "bf16", hw, cuda_graph=graph)
        assert p.chunks["fused"] == w * c, (m, n, k, w)
        res = strategies.simulate("ag_gemm", "fused", m=m, n=n, k=k, world_size=w, dtype="bf16", hw=hw,
                                  num_chunks=w * c, cuda_graph=graph, fast=True)
        assert p.predicted_ms["fused"] == res.makespan_ms
        seen.add(c)
    # eager too: the pieces' host calls run ahead of the GPU and hide under its work (issue 34.5)
    assert seen == {1, 2}
    # chosen: the Plan reports the pieces, explain() says so
    q = choose("ag_gemm", m=16384, n=1536, k=8192, world_size=8, dtype="bf16", hardware=hw,
               candidates=("fused",), cuda_graph=graph)
    assert q.strategy == "fused" and q.num_chunks == 8 * q.chunks_per_rank and q.num_sms == hw.sm_count - 1
    per = q.chunks_per_rank
    assert f"{per} piece{'s' if per > 1 else ''} per rank" in q.explain()


def test_copy_engine_and_fused_chunking_is_what_runs():
    for op in ("ag_gemm", "gemm_rs"):
        p = plan(op, m=16384, n=7168, k=8192, world_size=8)
        assert p.chunks["copy_engine"] == 8 and p.chunks["fused"] % 8 == 0
    # gemm_ar: one-shot (one chunk) up to 1 MiB of output, fused taking copy_engine's; above it
    # two-shot (fused's own when W | M)
    small = plan("gemm_ar", m=64, n=4096, k=1792, world_size=8)
    assert small.chunks["copy_engine"] == 1 and small.chunks["fused"] == 1
    big = plan("gemm_ar", m=128, n=8192, k=3584, world_size=8)
    assert big.chunks["copy_engine"] == 8 and big.chunks["fused"] == 8


# --- issue 33 items 6-8, issue 31 item 4: absurd arguments, the arithmetic, the stock baseline -------
@pytest.mark.parametrize("kwargs, error, text", [
    (dict(world_size=10**6), ValueError, "world_size: 1000000 is larger than 256"),
    (dict(world_size=2**31), ValueError, "world_size: 2147483648 is larger than 256"),
    (dict(m=10**30), ValueError, "m: 100000... (31 digits) is larger than"),
    (dict(m=10**400), ValueError, "(401 digits) is larger than 9223372036854775807 (int64)"),
    (dict(m=2**62, n=2**62, k=2**62), ValueError, "GiB of bf16, more than the 1024 GiB"),
    (dict(m=2**40, hardware="cpu-gloo"), ValueError, "a_shard [M/W, K] = [137438953472, 64] would take 1.6"),
    (dict(modelled="yes"), TypeError, "unexpected keyword argument 'modelled'"),
    (dict(group="world"), TypeError, "group: expected a torch.distributed.ProcessGroup"),
    (dict(m=100, world_size=8), ValueError, "M = 100 rows of the gathered a must be divisible by the world size 8"),
])
def test_absurd_plan_arguments_are_refused_at_once(kwargs, error, text):
    args = dict(m=4096, n=64, k=64, world_size=8, dtype="bf16", hardware="h200")
    args.update(kwargs)
    t0 = time.perf_counter()
    with pytest.raises(error) as info:
        plan("ag_gemm", **args)
    assert time.perf_counter() - t0 < 0.05
    assert text in str(info.value), str(info.value)


def test_every_plan_is_fast_whatever_the_sizes():
    from tpfuse.plan import MAX_WORLD_SIZE, _best_per_strategy

    _best_per_strategy.cache_clear()
    times = []
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        for hw in ("h200", "gb200", "cpu-gloo"):
            for m, n, k, w in ((2**28, 1024, 1024, 8), (2**20 * 256, 64, 64, MAX_WORLD_SIZE),
                               (2**20 * 72, 4096, 4096, 72), (2**30, 1, 1, 2), (0, 4096, 4096, 8)):
                t0 = time.perf_counter()
                plan(op, m=m, n=n, k=k, world_size=w, dtype="bf16", hardware=hw)
                times.append(time.perf_counter() - t0)
    times.sort()
    assert times[len(times) // 2] < 0.05, times  # median < 50 ms (m = 2**28 took 5 s before)
    assert times[-1] < 1.0, times  # W = 256 is the slowest (~40 ms on a loaded 2-core box)


def test_plan_refuses_what_the_ops_refuse_with_their_message():
    from types import SimpleNamespace

    from tpfuse import _checks

    ctx = SimpleNamespace(world_size=8, device_type="cpu", backend="gloo")
    with pytest.raises(ValueError) as from_op:
        _checks.check_call("gemm_rs", torch.empty(100, 4), torch.empty(4, 3), ctx, "auto")
    with pytest.raises(ValueError) as from_plan:
        plan("gemm_rs", m=100, n=3, k=4, world_size=8)
    assert str(from_op.value) == str(from_plan.value)
    assert "gemm_rs: M = 100 rows of a must be divisible by the world size 8" in str(from_plan.value)
    assert _run(["--op", "gemm_rs", "--m", "100", "--n", "3", "--k", "4", "--world-size", "8"]) == 2
    plan("gemm_ar", m=100, n=3, k=4, world_size=8)  # gemm_ar keeps every row on every rank


def test_plan_cli_refuses_m_not_divisible_by_w(capsys):
    assert _run(["--op", "ag_gemm", "--m", "16384", "--n", "64", "--k", "64", "--world-size", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must be divisible by the world size 3" in err[0] and "pad M to 16386" in err[0]


@pytest.mark.parametrize("graph", [False, True])
def test_host_time_is_its_own_field_and_exposed_comm_never_exceeds_comm(graph):
    cells = [("gemm_rs", 1024, 128, 4096, 2), ("gemm_ar", 128, 8192, 3584, 8), ("ag_gemm", 4096, 1792, 4096, 8),
             ("gemm_ar", 64, 4096, 1792, 4), ("gemm_rs", 16384, 8192, 3584, 8)]
    for op, m, n, k, w in cells:
        for cands in (ALL, ("unfused",)):
            p = choose(op, m=m, n=n, k=k, world_size=w, dtype="bf16", hardware="h200", candidates=cands,
                       cuda_graph=graph)
            b = p.breakdown
            assert 0 <= b["exposed_comm_ms"] <= b["comm_ms"], (op, m, n, k, w, b)
            assert b["host_ms"] >= 0 and (b["host_ms"] == 0 or not graph), (op, b)   # graphs: no host
            assert b["host_ms"] < p.predicted_ms[p.strategy]
            assert f"host {b['host_ms']:.4f} ms exposed" in p.explain()
    # the cell: host time was folded into exposed communication (0.109 vs 0.0105 ms)
    small = choose("gemm_rs", m=1024, n=128, k=4096, world_size=2, dtype="bf16", hardware="h200", candidates=ALL)
    assert small.breakdown["host_ms"] > small.breakdown["comm_ms"]


def test_speedup_is_against_the_stock_baseline():
    hw = get_profile("h200")
    p = plan("gemm_rs", m=16384, n=8192, k=3584, world_size=8, dtype="bf16", hardware="h200")
    stock = (cost.collective_ms("gemm_rs", 16384, 8192, 3584, 8, "bf16", hw)
             + cost.gemm_time_ms(16384, 8192, 3584, "bf16", hw) + hw.host_call_us * 1e-3)
    assert p.breakdown["baseline_ms"] == pytest.approx(stock)
    assert p.speedup == pytest.approx(stock / p.predicted_ms[p.strategy])
    assert 1.2 < p.speedup < 1.45, p.speedup  # the issue: 2.04 ms stock vs ~1.57 ms, not 1.88x vs tpfuse's unfused
    assert p.predicted_ms["unfused"] > p.breakdown["baseline_ms"]  # tpfuse's unfused: fp32 partials, casts
    text = p.explain()
    assert f"vs the stock baseline {stock:.4f} ms ({p.speedup:.2f}x" in text
    assert f"unfused {p.predicted_ms['unfused']:.4f} ms (tpfuse's)" in text  # a candidate like any other
    graph = plan("gemm_rs", m=16384, n=8192, k=3584, world_size=8, cuda_graph=True)
    assert graph.breakdown["baseline_ms"] == pytest.approx(stock - hw.host_call_us * 1e-3)
    assert plan("gemm_rs", m=0, n=8192, k=3584, world_size=8).speedup == 1.0


def test_plan_table_compares_with_the_stock_baseline(capsys):
    assert _run(["--op", "gemm_rs", "--m", "16384", "--n", "8192", "--k", "3584", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    p = plan("gemm_rs", m=16384, n=8192, k=3584, world_size=8)
    assert "stock ms" in out and "tpfuse unfused ms" in out and "the NCCL collective on the op's dtype" in out
    assert f"{p.breakdown['baseline_ms']:.4f}" in out and f"{p.predicted_ms['unfused']:.4f}" in out
