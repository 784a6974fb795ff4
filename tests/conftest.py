"""Shared fixtures: gloo rank pools reused across tests (spawning W processes costs seconds)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tpfuse.spawn import RankPool

# Every rank of the test pools poisons fresh outputs (NaN) and runs the cross-rank agreement check.
TEST_RANK_ENV = {"TPFUSE_POISON": "1", "TPFUSE_DEBUG": "1"}


def caught_then_probe(rank: int, call) -> tuple[tuple[str, str] | None, float]:
    """On a rank: ``call()``, catching ``TypeError``/``ValueError`` as (type name, message) or None;
    then a real all_reduce, which must still work.  Returns (caught, the probe's sum)."""
    try:
        call()
    except (TypeError, ValueError) as exc:
        caught = (type(exc).__name__, str(exc))
    else:
        caught = None
    probe = torch.full((1,), float(rank))
    dist.all_reduce(probe)
    return caught, probe.item()


class _Pools:
    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        """The pool of ``world_size`` ranks, (re)started if it is missing or was killed."""
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = RankPool(world_size, env=TEST_RANK_ENV)
            self._pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(W)`` -> a live :class:`tpfuse.spawn.RankPool` of W gloo ranks (shared per session)."""
    pools = _Pools()
    yield pools
    pools.close()
