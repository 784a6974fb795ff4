"""The bench's GPU paths: the one-GPU bed's rank placement, CUDA-event timeline spans, the comm
bench's copies (SM copy checked word for word), and a single-GPU ``tpfuse bench`` with graph
replay.  Correctness and shape of the results only; the numbers are the benchmark's business."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def where_am_i(rank, world_size):
    from tpfuse.spawn import OVERLAP_ENV

    return torch.cuda.current_device(), os.environ.get(OVERLAP_ENV), torch.distributed.get_backend()


def test_shared_device_pool_puts_every_rank_on_cuda0():
    from tpfuse.spawn import run_ranks

    assert run_ranks(where_am_i, 2, device="cuda:0", timeout=120) == [(0, "1", "gloo")] * 2


def test_cuda_spans_land_on_the_host_clock_in_order():
    from tpfuse import timeline

    dev = torch.device("cuda", 0)
    a = torch.randn(2048, 2048, device=dev)
    with timeline.recording(rank=0) as rec:
        with rec.span("gemm", "first", device=dev, chunk=0):
            a @ a
        with rec.span("gemm", "second", device=dev, chunk=1):
            a @ a
    first, second = rec.events()
    assert (first.name, second.name) == ("first", "second")
    assert first.start_ns <= first.end_ns <= second.start_ns <= second.end_ns


def test_comm_bench_on_gpu():
    from tpfuse.bench.comm import quick_comm_config, run_comm_bench, sm_copy

    src = torch.randint(-2**31, 2**31 - 1, (12345,), dtype=torch.int32, device="cuda")
    dst = torch.zeros_like(src)
    sm_copy(src, dst, 3)
    assert torch.equal(src, dst)
    result = run_comm_bench(quick_comm_config(iters=3))
    kinds = {r["kind"] for r in result["rows"]}
    assert kinds == ({"copy_engine", "sm_copy", "sm_workers"} if torch.cuda.device_count() > 1
                     else {"local_copy", "sm_copy", "sm_workers"})
    assert all(r["gb_per_s"] for r in result["rows"] if r["kind"] == "sm_workers")
    for r in result["rows"]:
        assert (r["latency_us"] is None) == bool(r["reasons"]), r
        assert "wrong data" not in str(r["reasons"])


def test_single_gpu_bench_has_graph_times():
    from tpfuse.bench.run import quick_config, run_bench

    result = run_bench(quick_config(on_gpu=True, world_size=1, phases=("decode",), iters=3))
    assert result["meta"]["mode"] == "single-gpu" and result["meta"]["gpu"]
    for r in result["rows"]:
        if r["ms"] is not None:
            assert r["graph_ms"] is not None or "graph" in r["reasons"]["graph_ms"].lower(), r
        assert r["asynctp_ms"] is not None or r["reasons"]["asynctp_ms"], r
