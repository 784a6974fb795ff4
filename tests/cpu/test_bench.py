"""`tpfuse bench`, `bench layer` and `bench comm` on CPU: every row has every field, a null field
has its reason, the derived fields follow from the measured ones, and the CLI's errors are one
line with exit code 2.  (No timing assertions: CPU times are only checked to be numbers.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tpfuse.bench import run as bench_run
from tpfuse.bench.run import ROW_FIELDS, format_rows, quick_config, run_bench, write_result
from tpfuse.bench.workloads import Workload
from tpfuse.cli import main

MEASURED = ("ms", "unfused_ms", "asynctp_ms", "gemm_ms", "comm_ms", "host_us", "graph_ms")


@pytest.fixture
def pool(rank_pool):
    return rank_pool(2)


def check_nulls_have_reasons(row: dict, fields) -> None:
    for field in fields:
        if row[field] is None:
            assert row["reasons"].get(field), (field, row)
        else:
            assert field not in row["reasons"], (field, row)


def test_bench_rows_every_field_in_one_run(pool, tmp_path):
    config = quick_config(phases=("decode",), iters=2, warmup=1, timeline=True)
    partial = []
    result = run_bench(config, ranks=pool, on_cell=partial.append)
    rows = result["rows"]
    # after the first of the two cells: its rows, marked incomplete (what a run cut short keeps)
    assert len(partial) == 1 and partial[0]["meta"]["complete"] is False
    assert partial[0]["meta"]["cells_done"] == 1 and partial[0]["rows"] == rows[:3]
    assert result["meta"]["complete"] is True
    assert [(r["cell"], r["strategy"]) for r in rows] == [
        (cell, s) for cell in ("8b-decode-fc1-tp2", "8b-decode-fc2-tp2") for s in ("unfused", "ring", "auto")]
    for r in rows:
        assert tuple(r) == ROW_FIELDS
        check_nulls_have_reasons(r, [f for f in ROW_FIELDS if f.endswith(("_ms", "_us", "_pct", "efficiency")) or
                                     f.startswith("speedup")])
        for field in ("ms", "unfused_ms", "gemm_ms", "comm_ms", "host_us", "agree_ms", "predicted_ms"):
            assert r[field] is not None and r[field] > 0, (field, r)
        assert r["asynctp_ms"] is None and "no CUDA" in r["reasons"]["asynctp_ms"]
        assert r["graph_ms"] is None and "no CUDA" in r["reasons"]["graph_ms"]
        assert r["spread_pct"] is None and "fewer than 4" in r["reasons"]["spread_pct"]   # iters=2
        assert r["exposed_comm_ms"] == pytest.approx(r["ms"] - r["gemm_ms"])
        assert r["overlap_efficiency"] == pytest.approx(max(r["gemm_ms"], r["comm_ms"]) / r["ms"])
        assert r["speedup_vs_unfused"] == pytest.approx(r["unfused_ms"] / r["ms"])
        assert r["resolved"] in ("unfused", "ring")
        assert r["op"] == ("ag_gemm" if r["gemm"] == "fc1" else "gemm_ar") and r["dtype"] == "fp32"
    meta = result["meta"]
    assert meta["mode"] == "cpu-gloo" and meta["backend"] == "gloo" and meta["processes"] == 2
    assert meta["gpu"] is None and meta["num_gpus"] == 0 and meta["hardware_profile"] == "cpu-gloo"
    for key in ("date", "host", "device", "torch", "triton", "command", "strategies_not_run"):
        assert key in meta
    assert set(meta["strategies_not_runnable"]) >= {"fused"} and "copy_engine" in meta["strategies_not_runnable"]
    assert "unfused" not in meta["strategies_not_runnable"]
    assert meta["checks"].startswith("per-call agreement round ON (TPFUSE_DEBUG=1)")   # the test pool's setting
    assert len(format_rows(result)) == len(rows) + 1
    # The first cell's timeline: a call span per strategy on each rank, the ring's GEMM per chunk.
    events = result["timeline"]["events"]
    assert result["timeline"]["cell"] == "8b-decode-fc1-tp2"
    for rank in (0, 1):
        assert [e["name"] for e in events if e["rank"] == rank and e["lane"] == "call"] == ["unfused", "ring"]
        assert sorted(e["chunk"] for e in events if e["rank"] == rank and e["lane"] == "gemm") == [0, 1]
    path = write_result(result, tmp_path)
    assert path.parent == tmp_path and path.name.endswith("_w2.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    assert not list(tmp_path.glob("*.tmp"))


def fake_rank(times: dict[str, list[float]], failed: dict[str, str], strategies=("unfused", "ring")) -> dict:
    variants = {k: {"times": v, "host": [x / 2 for x in v], "graph": None, "graph_reason": "no CUDA"}
                for k, v in times.items()}
    variants.update({k: {"reason": why} for k, why in failed.items()})
    return {"variants": variants, "strategies": strategies, "resolved": "ring"}


def test_rows_keep_the_torch_baseline_apart_from_the_unfused_strategy_and_carry_reasons():
    w = Workload("8b", "decode", "fc1", "ag_gemm", 8, 4, 4, 2)
    per_rank = [fake_rank({"unfused": [4.0, 4.0, 4.0], "@unfused": [2.0, 2.0, 2.0], "@gemm": [1.0, 1.0, 1.0],
                           "@comm": [1.5, 1.5, 1.5], "@agree": [0.5, 0.5, 0.5], "ring": [3.0, 1.0, 3.0]},
                          {"@asynctp": "no CUDA"}, ("unfused", "ring", "auto")),
                fake_rank({"unfused": [4.0, 5.0, 4.0], "@unfused": [2.0, 2.0, 2.0], "@gemm": [1.0, 1.0, 1.0],
                           "@comm": [1.5, 1.5, 1.5], "@agree": [0.5, 0.7, 0.5], "ring": [2.0, 2.0, 2.0]},
                          {"@asynctp": "no CUDA", "auto": "rank 1: RuntimeError: boom"}, ("unfused", "ring", "auto"))]
    per_rank[0]["variants"]["auto"] = {"reason": "rank 1: RuntimeError: boom"}
    rows = {r["strategy"]: r for r in bench_run._rows_for_cell(w, per_rank, {"unfused": 9.0, "ring": 8.0}, "fp32")}
    unfused, ring, auto = rows["unfused"], rows["ring"], rows["auto"]
    assert unfused["ms"] == 4.0 and unfused["unfused_ms"] == 2.0 and unfused["speedup_vs_unfused"] == 0.5
    assert ring["ms"] == 3.0  # per call the slowest rank (3, 2, 3), then the median
    assert ring["host_us"] == 1500.0 and ring["predicted_ms"] == 8.0
    assert ring["agree_ms"] == 0.5   # the agreement round alone: a column of its own, not inside ms
    assert ring["spread_pct"] is None and "fewer than 4" in ring["reasons"]["spread_pct"]
    assert ring["overlap_efficiency"] == 0.5 and ring["exposed_comm_ms"] == 2.0
    assert ring["speedup_vs_asynctp"] is None and "no CUDA" in ring["reasons"]["speedup_vs_asynctp"]
    assert auto["ms"] is None and auto["resolved"] == "ring" and auto["predicted_ms"] == 8.0
    for field in ("ms", "host_us", "graph_ms", "exposed_comm_ms", "overlap_efficiency", "speedup_vs_unfused"):
        assert auto[field] is None and "boom" in auto["reasons"][field], field
    for r in rows.values():
        assert tuple(r) == ROW_FIELDS


def test_layer_bench_rows(pool):
    from tpfuse.bench.layer import LAYER_ROW_FIELDS, format_layer_rows, quick_layer_config, run_layer_bench

    result = run_layer_bench(quick_layer_config(iters=2, warmup=1), ranks=pool)
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["tpfuse:auto", "tpfuse:unfused", "tpfuse:ring", "unfused", "asynctp", "compute_only"]
    for r in rows.values():
        assert tuple(r) == LAYER_ROW_FIELDS
        check_nulls_have_reasons(r, ("ms", "tokens_per_s_per_rank", "speedup_vs_unfused", "speedup_vs_asynctp"))
        assert (r["tokens"], r["hidden"], r["ffn"], r["world_size"]) == (256, 64, 224, 2)
        if r["ms"] is not None:
            assert r["tokens_per_s_per_rank"] == pytest.approx(128 / (r["ms"] / 1e3))
            assert r["speedup_vs_unfused"] == pytest.approx(rows["unfused"]["ms"] / r["ms"])
    assert rows["asynctp"]["ms"] is None and "no CUDA" in rows["asynctp"]["reasons"]["ms"]
    assert all(rows[v]["ms"] is not None for v in ("tpfuse:auto", "tpfuse:ring", "unfused", "compute_only"))
    for r in rows.values():   # CUDA-graph replays of the step: GPU only, each null with its reason
        check_nulls_have_reasons(r, ("graph_ms", "eager_over_graph"))
    assert "no CUDA" in rows["tpfuse:ring"]["reasons"]["graph_ms"]
    assert rows["tpfuse:auto"]["resolved"].startswith("fc1 ")
    assert len(format_layer_rows(result)) == len(rows) + 1
    assert result["meta"]["mode"] == "cpu-gloo"
    assert result["meta"]["checks"].startswith("per-call agreement round ON (TPFUSE_DEBUG=1)")


def test_comm_bench_schema_on_cpu(tmp_path, capsys):
    from tpfuse.bench.comm import COMM_ROW_FIELDS, SCHEMA

    out = tmp_path / "comm.json"
    assert main(["bench", "comm", "--quick", "--iters", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["schema"] == SCHEMA and result["meta"]["mode"] == "cpu-gloo"
    kinds = {}
    for r in result["rows"]:
        assert tuple(r) == COMM_ROW_FIELDS
        kinds.setdefault(r["kind"], []).append(r)
        check_nulls_have_reasons(r, ("latency_us", "gb_per_s"))
    assert sorted(kinds) == ["copy_engine", "host_copy", "sm_copy", "sm_workers"]
    assert [r["bytes"] for r in kinds["host_copy"]] == [2**16, 2**20, 2**24]
    for r in kinds["host_copy"]:
        assert r["gb_per_s"] == pytest.approx(r["bytes"] / (r["latency_us"] * 1e-6) / 1e9)
    assert all(r["latency_us"] is None and "no CUDA" in r["reasons"]["latency_us"]
               for r in kinds["copy_engine"] + kinds["sm_copy"] + kinds["sm_workers"])


def test_comm_bench_sm_workers_grid_rows_copy_and_label_the_same_gpu_peer(monkeypatch):
    """The sm_workers grid of ``tpfuse bench comm`` end to end but for the timing (CUDA events):
    every (size, chunk, CTAs, in flight) cell runs the worker kernel under TRITON_INTERPRET=1
    on CPU tensors, checks the copy and labels a same-device "peer" as the bed's."""
    from _symm_interp import interpreted

    from tpfuse.bench import comm

    timed = []

    def fake_time(copy, device, iters, warmup):
        copy()
        timed.append(device)
        return 0.5

    monkeypatch.setattr(comm, "_time_cuda", fake_time)
    monkeypatch.setattr(comm, "_triton_missing", lambda: None)
    cfg = comm.CommConfig(worker_sizes=(4096, 1000), worker_chunks=(256, 4096), worker_ctas=(1, 3, 64),
                          worker_inflight=(256, 1024))
    cpu = torch.device("cpu")
    with interpreted():   # drops the kernel modules before and after: decorated for the interpreter inside
        rows = comm._worker_rows(cfg, cpu, cpu, num_sms=8)
    assert len(rows) == len(timed) == 2 * 2 * 3 * 2   # CTAs capped at the SM count: 1, 3, 8
    for r in rows:
        assert tuple(r) == comm.COMM_ROW_FIELDS and r["kind"] == "sm_workers" and not r["reasons"]
        assert "same-GPU peer" in r["label"] and r["num_sms"] in (1, 3, 8)
        assert r["gb_per_s"] == pytest.approx(r["bytes"] / 0.5e-3 / 1e9)
    assert {(r["bytes"], r["chunk_bytes"], r["inflight_bytes"]) for r in rows} == {
        (b, c, i) for b in (4096, 1000) for c in (256, 4096) for i in (256, 1024)}


@pytest.mark.parametrize("argv, message", [
    (["bench", "--iters", "0"], "--iters: 0 must be >= 1"),
    pytest.param(["bench", "--bed", "2"], "--bed needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    (["bench", "--png", "speedups.jpg"], "--png speedups.jpg: the output is PNG; give a path ending in .png"),
    (["bench", "--timeline", "t.png", "--json", "t.json"], "is where --timeline writes its Chrome trace"),
    (["bench", "layer", "--tokens", "0"], "--tokens: 0 must be >= 1"),
    (["bench", "--strategies", "rign"], "--strategies: unknown strategy 'rign'"),
    (["bench", "comm", "--sizes", "6"], "--sizes: 6 must be >= 1 and a multiple of 4 bytes"),
    (["bench", "comm", "--worker-inflight", "1000"], "--worker-inflight: 1000 must be a power of two"),
    (["bench", "comm", "--worker-chunks", "6"], "--worker-chunks: 6 must be >= 1 and a multiple of 4 bytes"),
])
def test_cli_errors_are_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cli_quick_writes_json_png_and_timeline(tmp_path, capsys):
    paths = {name: tmp_path / f"{name}.{ext}" for name, ext in (("out", "json"), ("speedups", "png"), ("tl", "png"))}
    argv = ["bench", "--quick", "--phases", "decode", "--iters", "2", "--json", str(paths["out"]),
            "--png", str(paths["speedups"]), "--timeline", str(paths["tl"]), "--md", str(tmp_path / "t.md")]
    assert main(argv) == 0
    result = json.loads(paths["out"].read_text())
    assert result["meta"]["mode"] == "cpu-gloo" and len(result["rows"]) == 6
    assert all(not (isinstance(v, float) and math.isnan(v)) for r in result["rows"] for v in r.values())
    for name in ("speedups", "tl"):
        assert paths[name].read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((tmp_path / "tl.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"} == {0, 1}
    assert "auto->" in capsys.readouterr().out
    md = (tmp_path / "t.md").read_text().splitlines()
    assert md[0].startswith("### tpfuse bench: CPU") and "mode `cpu-gloo`" in md[2] and "torch " in md[2]
    assert md[4].startswith("| cell | strategy | ms |") and md[5].startswith("|---|")
    assert sum(line.startswith("| 8b-decode-") for line in md) == 6
    assert any(line.startswith("- `graph_ms` null: no CUDA") for line in md)


def test_speedup_chart_falls_back_to_asynctp_and_refuses_without_a_baseline(tmp_path):
    from tpfuse.bench import report

    def row(cell, strategy, ms, unfused, asynctp):
        return {"cell": cell, "strategy": strategy, "ms": ms, "unfused_ms": unfused, "asynctp_ms": asynctp,
                "gemm_ms": 0.5, "comm_ms": None}
    meta = {"device": "x", "processes": 2, "mode": "one-gpu-bed"}
    bed = {"meta": meta, "rows": [row("c1", "copy_engine", 1.0, None, 1.5), row("c2", "copy_engine", 2.0, None, None)]}
    assert report._baseline(bed["rows"]) == "asynctp_ms"
    assert report.draw_speedups(bed, tmp_path / "bed.png").read_bytes()[:4] == b"\x89PNG"
    assert report._baseline([row("c", "s", 1.0, 2.0, 1.5)]) == "unfused_ms"
    with pytest.raises(ValueError, match="nothing to draw"):
        report.draw_speedups({"meta": meta, "rows": [row("c", "s", 1.0, None, None)]}, tmp_path / "none.png")


def test_strategy_plan_in_the_bed_runs_only_symmetric_memory_strategies():
    why = {"fused": "fused is not part of this build"}.get
    names = ("unfused", "ring", "copy_engine", "fused", "auto")
    runnable = ("unfused", "ring", "copy_engine")
    run, skipped = bench_run.strategy_plan(names, runnable, "copy_engine", "one-gpu-bed", why)
    assert run == ["copy_engine", "auto"]
    assert skipped["fused"] == "fused is not part of this build"
    assert "gloo" in skipped["unfused"] and "gloo" in skipped["ring"]
    run, skipped = bench_run.strategy_plan(names, runnable, "ring", "one-gpu-bed", why)
    assert run == ["copy_engine"] and skipped["auto"].startswith("auto resolved to ring")
    run, skipped = bench_run.strategy_plan(names, runnable, "ring", "multi-gpu", why)
    assert run == ["unfused", "ring", "copy_engine", "auto"] and list(skipped) == ["fused"]


def test_bench_under_torchrun_runs_on_its_processes(tmp_path):
    """The multi-GPU launch path (torchrun starts the ranks, the bench spawns none), on gloo."""
    import os
    import subprocess
    import sys

    out = tmp_path / "trun.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "tpfuse", "bench", "--quick",
           "--phases", "decode", "--iters", "2", "--strategies", "unfused", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1  # rank 0 speaks
    result = json.loads(out.read_text())
    assert result["meta"]["processes"] == 2 and result["meta"]["mode"] == "cpu-gloo"
    assert [r["strategy"] for r in result["rows"]] == ["unfused", "unfused"]
    assert all(r["ms"] is not None for r in result["rows"])


def test_timed_rounds_interleaves_and_never_repeats_an_input_back_to_back():
    import torch

    from tpfuse.bench.common import timed_rounds

    calls = []
    fns = {name: (lambda c, name=name: calls.append((name, c))) for name in ("a", "b", "c")}
    out = timed_rounds(fns, iters=3, warmup=1, device=torch.device("cpu"))
    assert {k: len(v[0]) for k, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    timed = calls[3:]  # after one warm-up call each
    assert [name for name, _ in timed] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # each round starts one later
    assert [c for _, c in timed] == list(range(9))  # with n input copies, call c takes copy c % n


def test_a_cell_that_fails_on_a_rank_becomes_null_rows_and_the_bench_goes_on(pool):
    """A cell whose job raises on some rank (the bed's gemm_ar TimeoutError of 2026-12-01 ended
    the whole run) gives rows with every measured field null and the rank's exception as the
    reason, is listed in meta.cells_failed, and the next cells still run."""
    from tpfuse.bench import common
    from tpfuse.spawn import RankError

    class FirstCellFails:
        def __init__(self, pool):
            self.inner, self.world_size, self.rank, self.cells = common._PoolRanks(pool), pool.world_size, 0, 0

        def run(self, fn, *args, timeout=600.0):
            if fn.__name__ == "cell_job":
                self.cells += 1
                if self.cells == 1:
                    raise RankError({1: "Traceback (most recent call last):\n  ...\nTimeoutError: rank 1 waited 10 s\n"})
            return self.inner.run(fn, *args, timeout=timeout)

    result = run_bench(quick_config(phases=("decode",), iters=2, warmup=1), ranks=FirstCellFails(pool))
    failed = [r for r in result["rows"] if r["cell"] == "8b-decode-fc1-tp2"]
    assert [r["strategy"] for r in failed] == ["auto"]
    for r in failed:
        assert tuple(r) == ROW_FIELDS and r["ms"] is None and r["graph_ms"] is None
        assert r["reasons"]["ms"] == "the cell failed: rank 1: TimeoutError: rank 1 waited 10 s"
        check_nulls_have_reasons(r, MEASURED)
    assert result["meta"]["cells_failed"] == {"8b-decode-fc1-tp2": "rank 1: TimeoutError: rank 1 waited 10 s"}
    later = [r for r in result["rows"] if r["cell"] == "8b-decode-fc2-tp2"]
    assert later and all(r["ms"] is not None and r["ms"] > 0 for r in later)


def test_spread_is_the_interquartile_range_of_the_slowest_rank():
    from tpfuse.bench.common import slowest_median, spread_pct

    per_rank = [[10.0, 10.0, 12.0, 8.0, 10.0], [9.0, 11.0, 10.0, 10.0, 30.0]]   # slowest: 10 11 12 10 30
    assert slowest_median(per_rank) == 11.0
    assert spread_pct(per_rank) == pytest.approx(100 * (12.0 - 10.0) / 11.0)
    assert spread_pct([[1.0, 2.0, 3.0]]) is None


def test_bench_ranks_time_without_the_per_call_agreement_round():
    """What a user runs in production: the spawned ranks set TPFUSE_DEBUG=0 (agree_ms is its cost)."""
    from tpfuse.bench import common

    assert common._RANK_ENV["TPFUSE_DEBUG"] == "0"


def test_demo_table_says_same_strategy_and_marks_noise():
    """Issue 31.2: auto that resolved to unfused is the baseline timed twice: no ratio; a ratio
    inside the noise band says so."""
    from tpfuse.demo import DemoRow, format_table

    def row(strategy, ms, spread, resolved=""):
        return DemoRow("c", "ag_gemm", strategy, 8, 8, 8, ms, 1e-7, resolved or strategy, 2, spread)

    table = format_table([row("unfused", 10.0, 20.0), row("ring", 8.0, 5.0), row("ring", 9.0, 5.0),
                          row("auto", 8.3, 5.0, resolved="unfused")])
    vs = [line[table[0].index("vs unfused")] for line in table[1:]]
    assert vs == ["baseline", "1.25x", "1.11x (noise)", "same strategy"]
    assert [line[table[0].index("spread")] for line in table[1:]] == ["20%", "5%", "5%", "5%"]


def test_demo_times_a_cells_strategies_in_turns_and_checks_each(pool):
    from tpfuse.demo import DemoConfig, demo_cells, demo_job

    w = demo_cells(DemoConfig(world_size=2, scale=64))[0]
    per_rank = pool.run(demo_job, w, ("unfused", "ring", "auto"), 4, False, timeout=300)
    for mine in per_rank:
        assert list(mine) == ["unfused", "ring", "auto"]
        for s, r in mine.items():
            assert len(r["times"]) == 4 and all(t > 0 for t in r["times"])
            assert r["err"] < 1e-5, (s, r["err"])
        assert mine["auto"]["resolved"] in ("unfused", "ring") and mine["ring"]["resolved"] == "ring"
