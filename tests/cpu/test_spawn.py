"""The rank harness: a hung rank is killed in bounded time and named with the last thing it did."""

from __future__ import annotations

import time

import pytest

from tpfuse._dist import breadcrumb
from tpfuse.spawn import run_ranks


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
