"""benchmarks/gemm_core.py --merge: the rows of partial runs (``--only`` shares of the shapes, as
two device calls of at most 10 minutes each take the 60-row fp8 benchmark) combined into one
result file, the summary recomputed, completeness stated, mismatched inputs refused."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="benchmarks/gemm_core.py imports the GEMM core")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gemm_core.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gemm_core_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _row(name, phase, ratio, graph_ratio, epi=0.01):
    return {"name": name, "phase": phase, "m": 16384, "n": 3584, "k": 4096, "ours_tflops": 900.0 * ratio,
            "cublas_tflops": 900.0, "ratio": ratio, "graph_ratio": graph_ratio,
            "epilogue_hook_graph_overhead": epi, "wait_hook_graph_overhead": -0.01}


def _write(tmp_path, name, rows, **meta):
    meta = {"date": "2026-12-02T06:00:00+00:00", "gpu": "NVIDIA H200", "num_gpus": 1, "torch": "2.11.0+cu130",
            "triton": "3.6.0", "dtype": "fp8", "world_size": 8, "command": f"python benchmarks/gemm_core.py {name}",
            **meta}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "summary": {}, "rows": rows}))
    return str(path)


def test_merge_orders_the_rows_recomputes_the_summary_and_says_what_is_missing(bench, tmp_path):
    expected = bench.expected_rows("fp8")
    assert len(expected) == 60 and expected[:2] == ["8B-fc1-train-tensorwise", "8B-fc1-train-rowwise"]
    late = _write(tmp_path, "b", [_row("70B-fc2-train-rowwise", "train", 0.8, 0.84, epi=0.06),
                                  _row("8B-fc1-train-rowwise", "train", 0.9, 0.9)], commit="318de09")
    early = _write(tmp_path, "a", [_row("8B-fc1-train-tensorwise", "train", 1.0, 1.0)])
    merged = bench.merge([late, early])
    assert [r["name"] for r in merged["rows"]] == ["8B-fc1-train-tensorwise", "8B-fc1-train-rowwise",
                                                   "70B-fc2-train-rowwise"]
    summary = merged["summary"]
    assert summary["graph_min_ratio"] == 0.84 and summary["graph_min_ratio_shape"] == "70B-fc2-train-rowwise"
    assert summary["graph_geomean_ratio"] == pytest.approx((1.0 * 0.9 * 0.84) ** (1 / 3))
    assert summary["epilogue_hook_graph_overhead_train_prefill_max"] == 0.06
    meta = merged["meta"]
    assert meta["complete"] is False and len(meta["missing"]) == 57 and "8B-fc2-train-tensorwise" in meta["missing"]
    assert [r["rows"] for r in meta["runs"]] == [2, 1] and meta["runs"][0]["commit"] == "318de09"
    assert meta["dtype"] == "fp8" and meta["gpu"] == "NVIDIA H200"


def test_a_complete_merge_says_so(bench, tmp_path):
    names = bench.expected_rows("bfloat16")
    half = len(names) // 2
    paths = [_write(tmp_path, f"p{i}", [_row(n, "train", 1.0, 1.0) for n in part], dtype="bfloat16")
             for i, part in enumerate((names[:half], names[half:]))]
    merged = bench.merge(paths)
    assert merged["meta"]["complete"] is True and merged["meta"]["missing"] == []
    assert [r["name"] for r in merged["rows"]] == names


def test_merge_refuses_a_row_twice_another_setup_or_a_foreign_file(bench, tmp_path):
    a = _write(tmp_path, "a", [_row("8B-fc1-train-tensorwise", "train", 1.0, 1.0)])
    twice = _write(tmp_path, "twice", [_row("8B-fc1-train-tensorwise", "train", 1.0, 1.0)])
    with pytest.raises(ValueError, match="in both"):
        bench.merge([a, twice])
    other = _write(tmp_path, "other", [_row("8B-fc2-train-tensorwise", "train", 1.0, 1.0)], triton="3.7.1")
    with pytest.raises(ValueError, match="triton='3.7.1'"):
        bench.merge([a, other])
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a result file"):
        bench.merge([a, str(foreign)])
    with pytest.raises(ValueError, match="no files"):
        bench.merge([])


def test_merge_from_the_command_line_writes_the_file(bench, tmp_path, capsys):
    a = _write(tmp_path, "a", [_row("8B-fc1-train-tensorwise", "train", 1.0, 0.97)])
    b = _write(tmp_path, "b", [_row("8B-fc1-train-rowwise", "train", 1.0, 0.9)])
    bench.main(["--merge", a, b, "--out", str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "gemm_core_fp8_h200.json").read_text())
    assert [r["name"] for r in written["rows"]] == ["8B-fc1-train-tensorwise", "8B-fc1-train-rowwise"]
    assert "missing 58" in capsys.readouterr().out


def test_rows_name_the_plain_kernel_and_the_config_switches(bench):
    # each row says which kernel ran (the ping-pong variant apart from gemm_ws) and the table's
    # config column shows the Gluon switches
    from types import SimpleNamespace
    from tpfuse import gemm as gc

    for kernel, name in (("gemm_kernel", "gemm_kernel"), ("gemm_ws_kernel", "gemm_ws"), ("gemm_pp_kernel", "gemm_pp"),
                         ("none", "gemm_kernel")):
        assert bench.kernel_name(SimpleNamespace(kernel=kernel)) == name
    base = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=5)
    assert bench.config_label(gc.GemmConfig(**base).to_dict()) == "128x128x128 w8s5"
    assert bench.config_label(gc.GemmConfig(**base, gluon=True).to_dict()) == "128x128x128 w8s5 ws"
    assert bench.config_label(gc.GemmConfig(**base, gluon=True, pingpong=True).to_dict()) == "128x128x128 w8s5 pp"


def test_rounds_time_each_ratios_two_variants_back_to_back_in_both_orders(bench):
    # a reported ratio's timings sit next to each other in every round (a group of three:
    # the epilogue hook with and without signals against one owner_order timing), each first
    # in half of the rounds; every variant is timed once per round, a missing one (a hook that
    # failed) leaving its partner alone
    keys = ["cublas", "ours", "round_order", "owner_order", "wait", "epilogue", "epilogue_signalled"]
    firsts = {pair: set() for pair in bench.TIMING_PAIRS}
    for r in range(6):
        order = bench.round_schedule(keys, r)
        assert sorted(order) == sorted(keys)
        for pair in bench.TIMING_PAIRS:
            at = sorted(order.index(k) for k in pair)
            assert at == list(range(at[0], at[0] + len(pair))), (pair, order)   # contiguous
            i, j = order.index(pair[0]), order.index(pair[1])
            assert abs(i - j) == 1
            firsts[pair].add(pair[0] if i < j else pair[1])
    assert all(len(f) == 2 for f in firsts.values())
    assert {tuple(bench.round_schedule(keys, r)[:2]) for r in range(6)} >= {("cublas", "ours"), ("ours", "cublas")}
    order = bench.round_schedule(["cublas", "ours", "round_order", "owner_order", "epilogue"], 1)
    assert sorted(order) == ["cublas", "epilogue", "ours", "owner_order", "round_order"]
