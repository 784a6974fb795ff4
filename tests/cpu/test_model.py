"""The performance model: hardware profiles, costs, and the pipeline simulator against closed forms."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tpfuse.model import cost
from tpfuse.model.hardware import (PROFILES, NcclFit, apply_calibration, detect, get_profile,
                                   load_calibration, profile_for_device_name)
from tpfuse.model.nccl_fit import CommRow, comm_rows_from_bench, fit_nccl
from tpfuse import dtypes, strategies
from tpfuse.model.simulate import draw_timeline
from tpfuse.strategies import fused

# the strategies with a model (every one of ours: sm_workers is predicted, chosen only on a measurement)
STRATEGIES = tuple(s for s in strategies.names() if strategies.info(s).schedule is not None)
simulate = strategies.simulate   # the engine replays the schedule each strategy declares

H200 = get_profile("h200")
# no launch overhead and no NCCL SM contention: every chunk of a uniform split costs the same
UNIFORM = dataclasses.replace(H200, gemm_launch_us=0.0, nccl_sms=0, ring_step_host_us=0.0)


def _label_duration(res, prefix):
    (d,) = {t.duration for t in res.tasks if t.rank == 0 and t.label.startswith(prefix)}
    return d


def _durations(res, engine, kind=None):
    return [t.duration for t in res.tasks
            if t.rank == 0 and t.engine == engine and (kind is None or t.kind == kind) and t.duration > 0]


# --- hardware -----------------------------------------------------------------------------------
def test_required_profiles_have_sources():
    for name in ("h100", "h200", "b200", "gb200", "h100-pcie", "l40s", "cpu-gloo"):
        p = PROFILES[name]
        for f in ("tflops_bf16", "hbm_gbps", "link_line_gbps", "link_nccl_gbps", "alpha_nccl_us"):
            assert p.source(f), f"{name}.{f} has no source"
    assert PROFILES["gb200"].max_domain == 72
    assert "ROUGH" in PROFILES["cpu-gloo"].description


def test_get_profile_errors_and_aliases():
    with pytest.raises(ValueError, match="hardware: unknown profile 'a100'.*h200"):
        get_profile("a100")
    assert get_profile("H200-SXM").name == "h200"


def test_device_name_mapping_and_detect_without_cuda():
    assert profile_for_device_name("NVIDIA H200") == "h200"
    assert profile_for_device_name("NVIDIA H100 80GB HBM3") == "h100"
    assert profile_for_device_name("NVIDIA H100 PCIe") == "h100-pcie"
    assert profile_for_device_name("NVIDIA GB200") == "gb200"
    assert profile_for_device_name("Tesla T4") is None
    import torch

    if not torch.cuda.is_available():
        assert detect().name == "cpu-gloo" and detect(torch.device("cuda", 0)).name == "cpu-gloo"
    # a device name (what fused passes, or torch.cuda.get_device_name's), a CPU device
    assert detect("NVIDIA H200") is detect("NVIDIA H200") is get_profile("h200")
    assert detect(torch.device("cpu")).name == detect("cpu").name == "cpu-gloo"
    with pytest.raises(TypeError, match="detect: expected None, a torch.device"):
        detect(2.5)


def test_packaged_calibration_applies(tmp_path):
    raw = get_profile("h200", calibration=False)
    assert raw.calibrated == ""
    assert H200.calibrated and H200.gemm_eff_max != raw.gemm_eff_max
    assert "calibrated" in H200.source("gemm_eff_max")
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"overrides": {"link_ce_gbps": 123.0}}))
    assert get_profile("h200", calibration=path).link_ce_gbps == 123.0
    with pytest.raises(ValueError, match="unknown or fixed field 'warp_speed'"):
        apply_calibration(raw, {"overrides": {"warp_speed": 9}})
    path.write_text("{not json")
    with pytest.raises(ValueError, match="calibration: cannot read"):
        load_calibration(path)


# --- cost ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(16, 4096, 1792), (512, 3584, 4096), (16384, 14336, 4096)])
def test_gemm_cost_monotone(shape):
    m, n, k = shape
    t = cost.gemm_time_ms(m, n, k, "bf16", H200)
    faster = dataclasses.replace(H200, tflops_bf16=2 * H200.tflops_bf16, hbm_gbps=2 * H200.hbm_gbps)
    assert cost.gemm_time_ms(m, n, k, "bf16", faster) <= t
    assert cost.gemm_time_ms(m, n, k, "bf16", H200, num_sms=100) >= t
    assert cost.gemm_time_ms(2 * m, n, k, "bf16", H200) >= t
    # the roofline is a floor the efficiency curve never beats
    assert t >= 2 * m * n * k / (H200.tflops_bf16 * 1e12) * 1e3


def test_transfer_cost_alpha_beta():
    t1 = cost.transfer_time_ms(1e6, "ce", H200)
    t2 = cost.transfer_time_ms(2e6, "ce", H200)
    assert t1 == pytest.approx(H200.alpha_ce_us * 1e-3 + 1e6 / (H200.link_ce_gbps * 1e9) * 1e3)
    assert t2 - t1 == pytest.approx(1e6 / (H200.link_ce_gbps * 1e9) * 1e3)
    assert cost.transfer_time_ms(1e6, "sm", H200, num_sms=4) > cost.transfer_time_ms(1e6, "sm", H200, num_sms=16)
    assert cost.transfer_time_ms(0, "ce", H200) == 0.0


LEADS = dataclasses.replace(UNIFORM, nccl_measured=())
MEASURED = dataclasses.replace(LEADS, nccl_measured=(NcclFit(world_size=2, bus_gbps=200.0, alpha_us=100.0),))


def test_nccl_table_used_at_its_world_size_only():
    total = 64e6
    lead = [cost.all_gather_ms(total, w, LEADS) for w in (2, 4)]
    # W=2: the measured entry, time = alpha + bytes per rank / bus (AR sends twice the bytes)
    assert cost.all_gather_ms(total, 2, MEASURED) == pytest.approx(0.1 + total / 2 / 200e9 * 1e3)
    assert cost.reduce_scatter_ms(total, 2, MEASURED) == pytest.approx(0.1 + total / 2 / 200e9 * 1e3)
    assert cost.all_reduce_ms(total, 2, MEASURED) == pytest.approx(0.1 + total / 200e9 * 1e3)
    # a ring step from Python is one NCCL call: the measured alpha and bus at that W
    assert cost.transfer_time_ms(1e6, "p2p", MEASURED, world_size=2) == pytest.approx(0.1 + 1e6 / 200e9 * 1e3)
    # elsewhere the leads, exactly as a profile without the table
    assert cost.all_gather_ms(total, 4, MEASURED) == lead[1]
    assert cost.transfer_time_ms(1e6, "p2p", MEASURED, world_size=4) == cost.transfer_time_ms(1e6, "p2p", LEADS)
    assert lead[0] == pytest.approx(total / 2 / (LEADS.link_nccl_gbps * 1e9) * 1e3 + LEADS.alpha_nccl_us * 1e-3)


def test_profile_without_table_predicts_as_before():
    """The packaged h200 with its W=2 table: every W=4/8 prediction equals the same profile without it."""
    bare = dataclasses.replace(H200, nccl_measured=())
    assert H200.nccl_fit(2) is not None and bare.nccl_fit(2) is None
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        for strategy in STRATEGIES:
            for w in (4, 8):
                a = simulate(op, strategy, m=4096, n=3584, k=4096, world_size=w, dtype="bf16", hw=H200)
                b = simulate(op, strategy, m=4096, n=3584, k=4096, world_size=w, dtype="bf16", hw=bare)
                assert a.makespan_ms == b.makespan_ms, (op, strategy, w)


def test_nccl_fit_recovers_alpha_and_bus():
    rows = [CommRow(f"r{i}", kind, 4, cost.nccl_bytes_per_rank(kind, total, 4),
                    0.035 + cost.nccl_bytes_per_rank(kind, total, 4) / 310e9 * 1e3)
            for i, (kind, total) in enumerate([("all_gather", 2e6), ("reduce_scatter", 64e6),
                                               ("all_reduce", 8e6), ("all_gather", 256e6)])]
    rows.append(CommRow("w8", "all_gather", 8, 1e6, 0.05))
    rows.append(CommRow("w8b", "all_gather", 8, 3e6, 0.07))
    fits = fit_nccl(rows)
    assert fits[4].fit.bus_gbps == pytest.approx(310.0) and fits[4].fit.alpha_us == pytest.approx(35.0)
    assert max(abs(e) for e in fits[4].rel_errors()) < 1e-9
    assert fits[8].fit.bus_gbps == pytest.approx(100.0) and fits[8].fit.alpha_us == pytest.approx(40.0)
    with pytest.raises(ValueError, match="world_size 2 has 1 row"):
        fit_nccl([CommRow("one", "all_gather", 2, 1e6, 0.1)])


def test_nccl_fit_reads_bench_rows_and_round_trips_through_calibration(tmp_path):
    bench = {"meta": {}, "rows": [
        {"name": "ag", "op": "ag_gemm", "m": 4096, "n": 8, "k": 4096, "world_size": 2, "ms": {"comm_alone": 0.2}},
        {"name": "rs", "op": "gemm_rs", "m": 16384, "n": 4096, "k": 8, "world_size": 2, "ms": {"comm_alone": 0.5}},
        {"name": "w1", "op": "ag_gemm", "m": 64, "n": 8, "k": 8, "world_size": 1, "ms": {"comm_alone": 0.0}},
    ]}
    rows = comm_rows_from_bench(bench)
    assert [(r.kind, r.bytes_per_rank) for r in rows] == [("all_gather", 4096 * 4096), ("reduce_scatter", 16384 * 4096)]
    (res,) = fit_nccl(rows).values()
    cal = {"meta": {"gpu": "test"}, "sources": {"nccl_measured": "synthetic"},
           "overrides": {"nccl_measured": {"2": {"bus_gbps": res.fit.bus_gbps, "alpha_us": res.fit.alpha_us}}}}
    prof = apply_calibration(get_profile("h200", calibration=False), cal)
    assert prof.nccl_fit(2) == res.fit and prof.source("nccl_measured") == "calibrated: synthetic"
    assert cost.all_gather_ms(4096 * 4096 * 2, 2, prof) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="nccl_measured"):
        apply_calibration(prof, {"overrides": {"nccl_measured": {"2": {"bus_gbps": -1, "alpha_us": 3}}}})
    # old calibration files (GEMM curve only) still load, without a table
    old = get_profile("h200", calibration="benchmarks/results/calibration_h200.json")
    assert old.nccl_measured == () and old.gemm_eff_max == H200.gemm_eff_max


@pytest.mark.parametrize("op", ["gemm_rs", "gemm_ar"])
def test_unfused_reduces_fp32_partials(op):
    """tpfuse's unfused gemm_rs/gemm_ar upcast the bf16 partial, reduce it in fp32 and downcast:
    slower than a bf16 NCCL reduction of the same partial; fp32 inputs need no casts."""
    m, n, k, w = 16384, 4096, 7168, 2
    up, comm, down = cost.unfused_collective_parts(op, m, n, k, w, "bf16", H200)
    assert up > 0 and down > 0
    assert comm == cost.collective_ms(op, m, n, k, w, "fp32", H200) > cost.collective_ms(op, m, n, k, w, "bf16", H200)
    gemm = cost.gemm_time_ms(m, n, k, "bf16", H200)
    res = simulate(op, "unfused", m=m, n=n, k=k, world_size=w, dtype="bf16", hw=H200, cuda_graph=True)
    assert res.makespan_ms == pytest.approx(gemm + up + comm + down)
    assert res.makespan_ms > gemm + cost.collective_ms(op, m, n, k, w, "bf16", H200)
    assert cost.unfused_collective_parts(op, m, n, k, w, "fp32", H200)[::2] == (0.0, 0.0)
    assert cost.unfused_collective_parts("ag_gemm", m, n, k, w, "bf16", H200) == (
        0.0, cost.collective_ms("ag_gemm", m, n, k, w, "bf16", H200), 0.0)


# --- simulator vs closed forms ------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(16384, 7168, 8192), (16384, 768, 8192), (8192, 256, 8192)])
def test_fused_ag_one_piece_per_rank_closed_form(shape):
    """W = 2, one piece per rank, CUDA graph: the publish launch (the shard read once, written
    to the slot and the gathered buffer), then the local half of the one GEMM while the peer's shard is pulled, then the peer's half:
    T = fill + max(GEMM / 2, pull) + GEMM / 2 (GEMM-bound: fill + GEMM; comm-bound: fill +
    pull + GEMM / 2)."""
    m, n, k = shape
    res = simulate("ag_gemm", "fused", m=m, n=n, k=k, world_size=2, dtype="bf16", hw=H200, num_chunks=2,
                   cuda_graph=True)
    core = cost.core_gemm_time_ms(m, n, k, "bf16", H200, hook="wait")
    assert sum(_durations(res, "gemm", "gemm")) == pytest.approx(core)
    (pull,) = _durations(res, "comm")
    assert pull == pytest.approx(cost.transfer_time_ms(m // 2 * k * 2, "ce", H200))
    fill = cost.reduce_time_ms(3 * (m // 2 * k * 2), H200)
    assert res.makespan_ms == pytest.approx(fill + max(core / 2, pull) + core / 2)
    assert res.makespan_ms >= max(core, pull)


def test_fused_rs_exposes_the_last_peer_chunks_stores():
    """fused gemm_rs: one launch in owner order (rank + 1 first, own rows last); the epilogue's
    stores to the peers trail the bands' compute, so what is exposed after the GEMM is the
    store backlog beyond the own chunk's compute; READY after the launch, then the reduce."""
    w = 4
    for n, k in ((8192, 3584), (8192, 256)):   # GEMM-bound, then store-bound
        res = simulate("gemm_rs", "fused", m=16384, n=n, k=k, world_size=w, dtype="bf16", hw=H200,
                       cuda_graph=True)
        tiles = [t for t in res.tasks if t.rank == 0 and t.kind == "gemm"]
        stores = [t for t in res.tasks if t.rank == 0 and t.engine == "comm"]
        assert {t.chunk for t in stores} == {1, 2, 3}             # to every peer, never to itself
        assert [t.chunk for t in tiles][0] == 1 and tiles[-1].chunk == 0  # owner order, own last
        (red,) = [t for t in res.tasks if t.rank == 0 and t.kind == "reduce"]
        assert red.start == pytest.approx(max(tiles[-1].end, max(t.end for t in stores)))
        shard_bytes = 16384 // w * n * 2
        assert sum(t.duration for t in stores) >= (w - 1) * shard_bytes / (H200.link_sm_max_gbps * 1e9) * 1e3
        assert red.duration == pytest.approx(cost.reduce_time_ms((w + 1) * shard_bytes, H200))
    assert max(t.end for t in stores) > tiles[-1].end  # store-bound: the backlog is the tail


@pytest.mark.parametrize("w", [2, 4, 8])
@pytest.mark.parametrize("shape", [(16384, 7168, 8192), (128, 7168, 8192)])
def test_ring_matches_closed_form(shape, w):
    m, n, k = shape
    ag = simulate("ag_gemm", "ring", m=m, n=n, k=k, world_size=w, dtype="bf16", hw=UNIFORM, cuda_graph=True)
    (t_g,), (t_c,) = set(_durations(ag, "gemm")), set(_durations(ag, "comm"))
    # local shard first: no fill, then W-1 steps of max(GEMM, transfer), then the last GEMM
    assert ag.makespan_ms == pytest.approx(t_g + (w - 1) * max(t_g, t_c))
    rs = simulate("gemm_rs", "ring", m=m, n=n, k=k, world_size=w, dtype="bf16", hw=UNIFORM, cuda_graph=True)
    (t_g,), (t_c,) = set(_durations(rs, "gemm", "gemm")), set(_durations(rs, "comm"))
    (t_up,), (t_add,), (t_down,) = ({_label_duration(rs, name)} for name in ("upcast", "add", "downcast"))
    # GEMM + upcast of the first partial, then W-1 steps of (transfer or next GEMM + upcast,
    # whichever is longer) + the add, then the downcast of the own shard
    assert rs.makespan_ms == pytest.approx(t_g + t_up + (w - 1) * (max(t_g + t_up, t_c) + t_add) + t_down)
    # fp32 partials on the wire: each transfer moves 4 bytes per element of a shard
    shard_bytes = (m // w) * n * dtypes.itemsize("fp32")
    assert t_c == pytest.approx(cost.transfer_time_ms(shard_bytes, "p2p", UNIFORM, world_size=w))


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_world_size_one_is_the_gemm(op, strategy):
    res = simulate(op, strategy, m=4096, n=4096, k=4096, world_size=1, dtype="bf16", hw=H200, cuda_graph=True)
    assert _durations(res, "comm") == []
    assert res.makespan_ms == pytest.approx(cost.gemm_time_ms(4096, 4096, 4096, "bf16", H200))
    assert res.ranks[0].exposed_comm == 0


@pytest.mark.parametrize("hw", [H200, get_profile("h200", calibration=False)], ids=["calibrated", "leads"])
def test_interior_optimum_in_pieces_per_rank(hw):
    """fused ag_gemm, CUDA graph: more pieces per rank let the GEMM start on a peer's first
    piece earlier (a shorter drain) but every piece pays a copy latency, so on a shape near the
    GEMM/transfer balance (K = 8192, N = 1536 per rank) the best count is interior."""
    shape = dict(m=16384, n=1536, k=8192, world_size=8, dtype="bf16", cuda_graph=True)
    times = [simulate("ag_gemm", "fused", hw=hw, num_chunks=8 * s, **shape).makespan_ms for s in (1, 2, 4, 8, 16)]
    best = times.index(min(times))
    assert 0 < best < len(times) - 1, times
    assert times[-1] > 1.01 * times[best], times
    no_alpha = dataclasses.replace(hw, alpha_ce_us=0.0)
    flat = [simulate("ag_gemm", "fused", hw=no_alpha, num_chunks=8 * s, **shape).makespan_ms
            for s in (1, 2, 4, 8, 16)]
    assert all(f <= t for f, t in zip(flat, times))
    assert flat.index(min(flat)) >= best  # the latency is what stops finer pieces


def test_rank_stats_add_up_and_skew_delays():
    base = simulate("gemm_rs", "fused", m=16384, n=8192, k=3584, world_size=4, dtype="bf16", hw=H200)
    for r in base.ranks:
        assert r.fill + r.steady + r.drain == pytest.approx(r.total)
        assert r.backlog >= 0 and r.gemm_busy > 0 and r.comm_busy > 0
    late = simulate("gemm_rs", "fused", m=16384, n=8192, k=3584, world_size=4, dtype="bf16",
                    hw=H200, skew_ms=(0.0, 0.5, 0.0, 0.0))
    assert late.makespan_ms >= base.makespan_ms + 0.4  # the late rank's own work ends later
    # rank 0 is the late rank's last peer in owner order: it waits for that partial to reduce
    assert late.ranks[0].total > base.ranks[0].total


def _issued(res, prefix):
    return [t for t in res.tasks if t.rank == 0 and t.engine == "host" and t.label.startswith(f"issue {prefix}")]


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_host_launches_as_built(op):
    """Eager: copy_engine issues one cuBLAS GEMM per chunk (W), each a host call of host_call_us;
    fused issues ONE GEMM launch (the core's host_core_call_us) whatever the pieces; both issue
    every copy and flag from the host too.  A CUDA graph drops them all."""
    w = 8
    shape = dict(m=16384, n=7168, k=8192, world_size=w, dtype="bf16", hw=H200)
    ce = simulate(op, "copy_engine", **shape)
    gemms = _issued(ce, "GEMM")
    assert len(gemms) == w and {t.duration for t in gemms} == {H200.host_call_us * 1e-3}
    pieces = 2 * w if op == "ag_gemm" else None
    fu = simulate(op, "fused", **shape, num_chunks=pieces)
    (launch,) = _issued(fu, "tiles")
    assert launch.duration == pytest.approx(H200.host_core_call_us * 1e-3)
    copies = _issued(fu, "pull") if op == "ag_gemm" else []
    assert len(copies) == ((w - 1) * 2 if op == "ag_gemm" else 0)
    for res in (ce, fu):
        host = sum(t.duration for t in res.tasks if t.rank == 0 and t.engine == "host")
        graph = simulate(op, res.strategy, **shape, num_chunks=res.num_chunks, cuda_graph=True)
        assert not [t for t in graph.tasks if t.engine == "host" and t.duration > 0]
        assert host > H200.host_op_us * 1e-3 and graph.makespan_ms <= res.makespan_ms


def test_only_fused_ag_has_a_chunk_knob():
    shape = dict(m=4096, n=1024, k=1024, world_size=4, dtype="bf16", hw=H200)
    assert simulate("gemm_rs", "copy_engine", **shape, num_chunks=4).num_chunks == 4
    with pytest.raises(ValueError, match="copy_engine runs ag_gemm with 4 chunk"):
        simulate("ag_gemm", "copy_engine", **shape, num_chunks=8)
    with pytest.raises(ValueError, match="fused runs gemm_rs with 4 chunk"):
        simulate("gemm_rs", "fused", **shape, num_chunks=8)
    assert simulate("ag_gemm", "fused", **shape, num_chunks=8).num_chunks == 8
    # gemm_ar: one-shot up to 1 MiB of output (fused takes copy_engine's), else two-shot (fused's
    # own when W | M, else copy_engine's)
    assert simulate("gemm_ar", "copy_engine", **dict(shape, m=128)).num_chunks == 1
    assert simulate("gemm_ar", "copy_engine", **shape).num_chunks == 4
    assert simulate("gemm_ar", "fused", **dict(shape, m=128)).num_chunks == 1
    one_shot = simulate("gemm_ar", "copy_engine", **dict(shape, m=128), cuda_graph=True).makespan_ms
    assert simulate("gemm_ar", "fused", **dict(shape, m=128), cuda_graph=True).makespan_ms == one_shot
    assert simulate("gemm_ar", "fused", **shape).num_chunks == 4
    assert simulate("gemm_ar", "fused", **dict(shape, m=4098)).num_chunks == 4   # copy_engine's two-shot


def test_simulate_validates():
    with pytest.raises(ValueError, match="num_chunks: 6 is not a multiple of world_size 4"):
        simulate("ag_gemm", "fused", m=64, n=8, k=8, world_size=4, dtype="bf16", hw=H200, num_chunks=6)
    with pytest.raises(ValueError, match="unknown strategy 'magic'"):
        simulate("ag_gemm", "magic", m=64, n=8, k=8, world_size=4, dtype="bf16", hw=H200)
    with pytest.raises(ValueError, match="skew_ms: 1 values for world_size 2"):
        simulate("ag_gemm", "ring", m=64, n=8, k=8, world_size=2, dtype="bf16", hw=H200, skew_ms=(0.0,))


def test_timeline_png(tmp_path):
    res = simulate("ag_gemm", "fused", m=4096, n=7168, k=8192, world_size=4, dtype="bf16",
                   hw=H200, num_chunks=8, skew_ms=(0.0, 0.02, 0.0, 0.01))
    out = tmp_path / "timeline.png"
    draw_timeline(res, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
def test_ring_pays_its_host_steps(op):
    """The host issues a ring step by step; with host steps longer than the GPU work, the ring
    runs at the host's pace (W steps, plus W-1 for gemm_ar's all-gather)."""
    m, n, k, w = 256, 1024, 1024, 4
    slow = dataclasses.replace(UNIFORM, ring_step_host_us=500.0)
    fast = simulate(op, "ring", m=m, n=n, k=k, world_size=w, dtype="bf16", hw=UNIFORM).makespan_ms
    res = simulate(op, "ring", m=m, n=n, k=k, world_size=w, dtype="bf16", hw=slow).makespan_ms
    steps = w + (w - 1 if op == "gemm_ar" else 0)
    assert fast < steps * 0.5 <= res
    assert res < steps * 0.5 + fast


def test_ring_step_host_fit_from_bench_host_times():
    from tpfuse.model.nccl_fit import ring_step_host_us
    rows = [{"name": "a", "op": "ag_gemm", "world_size": 2, "host_ms": {"unfused": 0.4, "ring": 0.9}},
            {"name": "b", "op": "gemm_rs", "world_size": 4, "host_ms": {"unfused": 0.5, "ring": 1.7}},
            {"name": "c", "op": "gemm_ar", "world_size": 2, "host_ms": {"unfused": 0.5, "ring": 1.4}},
            {"name": "d", "op": "gemm_ar", "world_size": 2, "host_ms": {"unfused": 0.5}}]
    median, per_row = ring_step_host_us({"rows": rows})
    # (0.5 / 2 steps, 1.2 / 4 steps, 0.9 / 3 steps) ms -> 250, 300, 300 us; row d has no ring time
    assert [n for n, _ in per_row] == ["a", "b", "c"]
    assert median == pytest.approx(300.0)
    assert ring_step_host_us({"rows": rows[3:]}) is None


# --- host model (issues 22.6, 34.5) and the planner's symmetric replay ---------------------------
@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eager_host_time_overlaps_the_gpu_and_graphs_drop_it(op, strategy):
    """Eager calls never wait for the GPU: the host issues ahead while earlier GPU work runs, so
    an op takes the longer of its GPU time (its graph replay) and its host time (dispatch plus
    one host call per launch) -- a GPU-bound op costs its graph time, a host-bound one its host
    time.  CUDA-graph replay: no host time at all."""
    for shape in (dict(m=16384, n=7168, k=8192), dict(m=128, n=256, k=256)):   # GPU-bound, host-bound
        shape.update(world_size=8, dtype="bf16", hw=H200)
        eager = simulate(op, strategy, **shape)
        graph = simulate(op, strategy, **shape, num_chunks=eager.num_chunks, cuda_graph=True)
        assert not [t for t in graph.tasks if t.engine == "host" and t.duration > 0]
        host = max(sum(t.duration for t in eager.tasks if t.rank == r and t.engine == "host") for r in range(8))
        assert host >= (H200.host_op_us + H200.host_call_us) * 1e-3 - 1e-12 or strategy == "ring"
        assert eager.makespan_ms == pytest.approx(max(graph.makespan_ms, host), rel=1e-9)
        # device work starts at once: no device task waits for its issue
        assert min(t.start for t in eager.tasks if t.engine != "host" and t.duration > 0) == 0.0


def test_a_gpu_bound_eager_call_costs_its_graph_time():
    """70B fc1 training at TP 8 (issue 34.5): eager was charged a host sync (3.14 ms vs 2.91 ms
    for the graph replay of the same schedule); the host now hides under the GPU work."""
    shape = dict(m=16384, n=2 * 28672 // 8, k=8192, world_size=8, dtype="bf16", hw=H200)
    for s in ("copy_engine", "fused"):
        eager = simulate("ag_gemm", s, **shape)
        assert eager.makespan_ms == simulate("ag_gemm", s, **shape, num_chunks=eager.num_chunks,
                                             cuda_graph=True).makespan_ms


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("graph", [False, True])
def test_symmetric_replay_equals_the_full_one(op, strategy, graph):
    w = 4
    chunks = 2 * w if (strategy, op) == ("fused", "ag_gemm") else None
    for m in (4096, 128):   # shards a multiple of the fused tile height, and one tile for all
        shape = dict(m=m, n=7168, k=2048, world_size=w, dtype="bf16", hw=H200, num_chunks=chunks,
                     cuda_graph=graph)
        full = simulate(op, strategy, **shape)
        fast = simulate(op, strategy, **shape, fast=True)
        assert fast.makespan_ms == pytest.approx(full.makespan_ms, rel=1e-12)
        assert fast.fill_ms == pytest.approx(full.fill_ms) and fast.drain_ms == pytest.approx(full.drain_ms)
        assert len(fast.tasks) < len(full.tasks) / (w - 1)
        chunks = None if m == 4096 else chunks


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_symmetric_replay_of_unaligned_shards_is_the_straddling_rank(op):
    """Shards of 200 rows: rank r's first M-tile (128 rows) straddles rank r-1's rows (which fused
    ag_gemm pulls last), so the ranks differ; the fast replay follows rank 1 (straddling), never
    rank 0 (aligned, the optimistic one).  Exact for ag_gemm, whose only cross-rank waits are
    the peers' READY at the start; gemm_rs also waits for the peers' (differently cut) GEMMs."""
    shape = dict(m=800, n=7168, k=8192, world_size=4, dtype="bf16", hw=H200, cuda_graph=True)
    full = simulate(op, "fused", **shape)
    fast = simulate(op, "fused", **shape, fast=True)
    if op == "ag_gemm":
        assert fast.ranks[0].total == pytest.approx(full.ranks[1].total, rel=1e-9)
        assert fast.ranks[0].total > full.ranks[0].total
    assert fast.makespan_ms == pytest.approx(full.makespan_ms, rel=0.02)


def test_nccl_fit_reads_the_bench_rows_of_today_once_per_cell():
    from tpfuse.model.nccl_fit import comm_rows_from_bench

    row = {"cell": "8b-prefill-fc1-tp2", "op": "ag_gemm", "m": 64, "n": 8, "k": 16, "world_size": 2,
           "dtype": "bf16", "comm_ms": 0.1}
    rows = comm_rows_from_bench({"rows": [dict(row, strategy="unfused", ms=0.3), dict(row, strategy="ring", ms=0.2),
                                          dict(row, cell="other", comm_ms=None)]})
    assert [(r.name, r.kind, r.ms) for r in rows] == [("8b-prefill-fc1-tp2", "all_gather", 0.1)]


# --- the fused GEMM core's calibration and the chunk knob (tpfuse/strategies/fused.py) ----------------
def _core_rows():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    return json.loads((root / "gemm_core_h200_2026-12-01_run21.json").read_text())["rows"]   # the run the calibration cites


def test_core_gemm_calibration_reproduces_its_measurements():
    """The core's hooked time (cuBLAS / core_gemm_rel * (1 + rel) + us) against what
    benchmarks/gemm_core.py measured with the hooks on, from the measured cuBLAS time of the same
    shape, on the shapes the fused GEMM runs (full M: training, prefill, decode)."""
    assert "gemm_core_h200.json" in H200.source("core_gemm_rel") and H200.source("host_core_call_us")
    for hook, key, worst in (("wait", "wait_graph_ms", 0.15), ("epilogue", "epilogue_graph_ms", 0.25)):
        rel, us = getattr(H200, f"core_{hook}_rel"), getattr(H200, f"core_{hook}_us")
        errs = sorted(abs((r["cublas_graph_ms"] / H200.core_gemm_rel * (1 + rel) + us * 1e-3) / r[key] - 1)
                      for r in _core_rows() if r["phase"] in ("train", "prefill", "decode"))
        assert len(errs) == 18 and errs[len(errs) // 2] < 0.05 and errs[-1] < worst, (hook, errs)
    # the model: never faster than the cuBLAS model of the same shape, hooks never free
    for shape in ((16384, 7168, 8192), (128, 8192, 3584)):
        cublas = cost.gemm_time_ms(*shape, "bf16", H200)
        plain = cost.core_gemm_time_ms(*shape, "bf16", H200)
        assert cublas < plain <= cost.core_gemm_time_ms(*shape, "bf16", H200, hook="wait")
        assert plain < cost.core_gemm_time_ms(*shape, "bf16", H200, hook="epilogue")


def test_sm_budget_matches_the_strategy():
    fused_sm_budget = fused.model_sm_budget
    # every SM but one (the side stream's flag kernels need one while the GEMM's tiles spin)
    assert fused_sm_budget(H200, 8) == H200.sm_count - 1 == 131 and fused_sm_budget(H200, 1) == 132
    assert fused_sm_budget(H200, 4, shared_gpu=True) == 26 and fused_sm_budget(132, 1, shared_gpu=True) == 132
    # a smaller grid is never faster
    args = dict(m=16384, n=7168, k=8192, world_size=8, dtype="bf16", hw=H200, cuda_graph=True)
    assert simulate("ag_gemm", "fused", **args, num_sms=26).makespan_ms > simulate("ag_gemm", "fused", **args).makespan_ms


def test_chunk_knob():
    import time
    FUSED_TILE_M, fused_ag_chunks_per_rank, piece_candidates = fused.TILE_M, fused.planned_chunks_per_rank, \
        fused.piece_candidates

    # equal pieces of >= 128 rows (the fused GEMM's tile height) only
    assert piece_candidates(255) == (1,) and piece_candidates(384) == (1, 2) and piece_candidates(512) == (1, 2, 4)
    assert piece_candidates(258) == (1, 2) and piece_candidates(1030) == (1, 2)   # 1030 / 4 is not whole
    knob = fused_ag_chunks_per_rank
    # small M: every piece would split a tile -> 1
    for m_shard in (1, 16, 64, 128, 200, 255):   # no candidate but 1
        assert knob(m_shard, 7168, 8192, 8, "bf16", H200) == 1
        assert knob(m_shard, 7168, 8192, 8, "bf16", H200, cuda_graph=True) == 1
    assert knob(0, 7168, 8192, 8, "bf16", H200) == 1 and knob(4096, 7168, 8192, 1, "bf16", H200) == 1
    # a GEMM-bound shape: the local chunk hides the first pull, one piece per rank
    assert knob(2048, 7168, 8192, 8, "bf16", H200, cuda_graph=True) == 1
    # near the GEMM/transfer balance, without host time: pieces shorten the drain
    c = knob(2048, 1536, 8192, 8, "bf16", H200, cuda_graph=True)
    assert c in (2, 4) and 2048 // c >= FUSED_TILE_M
    # deterministic, the same for a torch dtype and a profile name, and fast uncached
    import torch
    assert knob(2048, 1536, 8192, 8, torch.bfloat16, "h200", cuda_graph=True) == c
    knob.cache_clear()
    t0 = time.perf_counter()
    for w in (2, 4, 8):
        knob(16384 // w, 1536 * 8 // w, 8192, w, "bf16", H200)
    assert (time.perf_counter() - t0) / 3 < 0.005 * 4   # < 5 ms a call alone; 4x slack on a shared box


# --- sm_workers: workers as a resource -------------------------------------------------------------
def test_worker_bandwidth_grows_with_workers_and_bytes_in_flight_up_to_the_sm_ceiling():
    bw = cost.worker_gbps
    assert bw(H200, 1, 256) < bw(H200, 1, 4096) < bw(H200, 4, 4096) <= bw(H200, 16, 16384)
    assert bw(H200, 128, 65536) == H200.link_sm_max_gbps                 # the SM-driven ceiling
    assert bw(H200, 1, 1 << 20) == H200.link_sm_gbps_per_sm              # one SM's peer rate
    # small chunks pay the per-chunk alpha: bandwidth(chunk) = bytes / time grows with the chunk
    rate = [n / cost.worker_transfer_time_ms(n, H200, workers=16, in_flight_bytes=16384) for n in (4096, 1 << 16, 1 << 22)]
    assert rate == sorted(rate) and cost.worker_transfer_time_ms(0, H200, workers=1, in_flight_bytes=256) == 0.0
    with pytest.raises(ValueError, match="workers=0"):
        bw(H200, 0, 256)


def test_staged_partials_producer_waits_for_the_credit_of_the_slot_it_reuses():
    """sm_workers' ring in the simulator: with 1 slot the GEMM of piece j starts only after the
    workers pushed piece j - 1 (its credit), with 2 slots after piece j - 2; slow workers
    (1 CTA, 256 bytes in flight) make the producer wait, and more slots never make it slower."""
    from tpfuse.model import steps
    from tpfuse.model.simulate import Schedule, simulate as run

    def schedule(slots, workers, in_flight):
        def move(nbytes):
            return cost.worker_transfer_time_ms(nbytes, H200, workers=workers, in_flight_bytes=in_flight)

        def build(g, c):
            steps.reduce_scatter(g, c, lambda g, c, b: steps.staged_partials(g, c, b, move=move, slots=slots,
                                                                             chunk_rows=256))
        return Schedule(build, kind="pipeline", num_chunks=lambda op, world_size, **_: world_size)

    shape = dict(m=4 * 1024, n=4096, k=1024, world_size=4, dtype="bf16", hw=H200)
    ms = {}
    for slots in (1, 2, 4):
        res = run("gemm_rs", schedule(slots, 1, 256), **shape)
        ms[slots] = res.makespan_ms
        mine = [t for t in res.tasks if t.rank == 0]
        gemms = [t for t in mine if t.label.startswith("GEMM ") and "." in t.label]
        pushes = [t for t in mine if t.label.startswith("push ")]
        assert len(gemms) == len(pushes) == 3 * 4                         # 3 peer owners x 4 pieces of 256 rows
        for j in range(slots, len(gemms)):
            assert gemms[j].start >= pushes[j - slots].end - 1e-12
        # the credit is binding: the producer idles waiting for the slow workers
        assert any(gemms[j].start > gemms[j - 1].end + 1e-6 for j in range(slots, len(gemms)))
    assert ms[4] <= ms[2] <= ms[1]
    fast = run("gemm_rs", schedule(1, 16, 16384), **shape).makespan_ms
    assert fast < ms[1]
