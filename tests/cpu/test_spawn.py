"""The rank harness: a hung rank is killed in bounded time and named with the last thing it did."""

from __future__ import annotations

import time

import pytest

from tpfuse._dist import breadcrumb
from tpfuse.spawn import RankPool, run_ranks


def hang_on_rank_one(rank, world_size):
    breadcrumb("a long first step that is overwritten by the next one " * 3)
    breadcrumb(f"rank {rank} about to wait")
    if rank == 1:
        time.sleep(600)
    return rank


def test_hung_rank_is_named_with_its_last_step():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(hang_on_rank_one, 2, timeout=8)
    assert time.monotonic() - t0 < 60
    msg = str(info.value)
    assert "rank 1 last did: 'rank 1 about to wait'" in msg, msg


def test_shared_device_option_is_checked_before_spawning():
    """``device="cuda:N"`` (the one-GPU bed) needs gloo and a visible GPU N; the children get the
    overlap switch for symmetric memory.  Every misuse is one ValueError/TypeError, no process."""
    import torch

    from tpfuse.spawn import OVERLAP_ENV, RankPool, shared_device_env

    assert shared_device_env(0) == {OVERLAP_ENV: "1"} and OVERLAP_ENV == "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"
    assert shared_device_env(None) == {}
    with pytest.raises(ValueError, match="nccl refuses"):
        RankPool(2, backend="nccl", device="cuda:0")
    with pytest.raises(ValueError, match="'cuda:N'"):
        RankPool(2, device="gpu0")
    with pytest.raises(TypeError, match="device"):
        RankPool(2, device=0)
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match="needs a CUDA device 0; this machine has 0"):
            RankPool(2, device="cuda")


def leave_a_breadcrumb(rank, world_size):
    breadcrumb(f"rank {rank}: a step of the first job")
    return rank


def hang_without_a_breadcrumb(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def test_timeout_does_not_name_a_step_of_an_earlier_job():
    with RankPool(2) as pool:
        assert pool.run(leave_a_breadcrumb, timeout=30) == [0, 1]
        with pytest.raises(TimeoutError) as info:
            pool.run(hang_without_a_breadcrumb, timeout=5)
    msg = str(info.value)
    assert "first job" not in msg and "rank 1 last did: nothing recorded in this job" in msg, msg


def test_breadcrumbs_are_stores_into_the_mapped_file(tmp_path, monkeypatch):
    """tpfuse._dist.breadcrumb (on every op's path): the file holds the last message, padded,
    as the spawn harness reads it (text, stripped), and clear_breadcrumb blanks it."""
    from tpfuse import _dist

    monkeypatch.setenv("TPFUSE_BREADCRUMBS", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    _dist._breadcrumb_map.cache_clear()
    try:
        path = tmp_path / "rank3.txt"
        _dist.clear_breadcrumb()                          # the harness's first call
        assert path.read_text() == " " * 200              # mapped: blank, not NUL bytes
        _dist.breadcrumb("copy_engine ag_gemm: publishing the local shard")
        _dist.breadcrumb("fused gemm_rs: the GEMM stores into the owners' inboxes")
        assert path.read_text().strip() == "fused gemm_rs: the GEMM stores into the owners' inboxes"
        _dist.breadcrumb("x" * 500)                      # cut to one padded line
        assert path.read_text() == "x" * 199 + "\n" and path.stat().st_size == 200
        _dist.clear_breadcrumb()
        assert path.read_text().strip() == ""
    finally:
        _dist._breadcrumb_map.cache_clear()
