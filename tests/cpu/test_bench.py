"""`tpfuse bench` on CPU gloo ranks: every cell gets every strategy, the parts alone and the
planner's prediction; the JSON is written whole (never a partial file)."""

from __future__ import annotations

import json
import subprocess
import sys

from tpfuse.bench.run import BenchConfig, format_rows, run_bench, write_result


def test_bench_rows_and_json(tmp_path):
    config = BenchConfig(world_size=2, models=("8b",), phases=("prefill", "decode"), iters=2, warmup=1,
                         scale=64, device="cpu")
    result = run_bench(config)
    rows = result["rows"]
    assert [r["name"] for r in rows] == ["8b-prefill-fc1-tp2", "8b-prefill-fc2-tp2",
                                         "8b-decode-fc1-tp2", "8b-decode-fc2-tp2"]
    for r in rows:
        assert set(r["ms"]) == {"unfused", "ring", "auto", "gemm_alone", "comm_alone"}
        assert all(v > 0 for v in r["ms"].values()), r["ms"]
        assert r["auto_resolved"] in ("unfused", "ring")
        assert set(r["predicted_ms"]) == {"unfused", "ring"}
    assert result["meta"]["world_size"] == 2 and result["meta"]["backend"] == "gloo"
    assert len(format_rows(result)) == len(rows) + 1
    path = write_result(result, tmp_path)
    assert path.parent == tmp_path and path.name.startswith("bench_") and path.name.endswith("_w2.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    assert not list(tmp_path.glob("*.tmp"))


def test_bench_cli_rejects_bad_numbers():
    proc = subprocess.run([sys.executable, "-m", "tpfuse", "bench", "--iters", "0"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--iters: 0 must be >= 1" in proc.stderr
