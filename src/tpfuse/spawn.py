"""Run a function on W ranks without torchrun: the harness of the tests and the demo.

CPU ranks use gloo; ``backend="nccl"`` puts rank r on GPU r (for the demo on a GPU machine);
``device="cuda:0"`` puts every rank on that one GPU with a gloo group and
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` (the one-GPU bed of DESIGN §6: symmetric memory
works across the W processes; NCCL refuses two ranks on one GPU, and gloo cannot carry CUDA
tensors there).  Running the processes under MPS (``nvidia-cuda-mps-control -d``) is the
caller's job.

    with RankPool(world_size=4) as pool:
        results = pool.run(fn, arg1, arg2, timeout=60)   # fn(rank, world_size, arg1, arg2) on every rank

A :class:`RankPool` spawns W processes once, initializes one gloo process group in them (free
TCP port on 127.0.0.1, ``torch.set_num_threads(1)`` so W ranks share few cores fairly) and then
runs any number of jobs.  A job that raises on some rank raises :class:`RankError` with that
rank and its traceback; a job that does not finish within ``timeout`` seconds kills the pool
and raises ``TimeoutError`` naming the ranks that hung and the last step each recorded (see
:func:`tpfuse._dist.breadcrumb`).  Functions must be importable (module level) to be sent to
the spawned processes.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import re
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankPool", "RankError", "run_ranks", "free_port", "shared_device_env"]

# Lets torch's symmetric memory rendezvous ranks that share one GPU (the one-GPU bed).
OVERLAP_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


class RankError(RuntimeError):
    """A job raised on one or more ranks; ``.failures`` maps rank -> formatted traceback."""

    def __init__(self, failures: dict[int, str]):
        self.failures = failures
        first = min(failures)
        super().__init__(f"job failed on rank(s) {sorted(failures)}; rank {first}:\n{failures[first]}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse_device(device: str | None, backend: str) -> int | None:
    """The CUDA index every rank shares, from ``device`` ("cuda" or "cuda:N"), or None."""
    if device is None:
        return None
    if not isinstance(device, str):
        raise TypeError(f"device: expected a string like 'cuda:0' or None, got {type(device).__name__}")
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        raise ValueError(f"device: {device!r} is not supported; use 'cuda:N' (every rank on GPU N) or None")
    if backend != "gloo":
        raise ValueError(f"device: {device!r} puts every rank on one GPU, which {backend} refuses; "
                         "use backend='gloo' (symmetric memory carries the data there)")
    import torch

    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {device!r} needs a CUDA device {index}; this machine has "
                         f"{torch.cuda.device_count()} visible GPU(s)")
    return index


def shared_device_env(index: int | None) -> dict[str, str]:
    """Environment of the ranks that share GPU ``index`` (empty when they do not share one)."""
    return {} if index is None else {OVERLAP_ENV: "1"}


def _worker(rank: int, world_size: int, port: int, env: dict[str, str], jobs: mp.Queue, results: mp.Queue,
            pg_timeout_s: float, backend: str, device_index: int | None = None) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from tpfuse._dist import clear_breadcrumb

    torch.set_num_threads(1)
    try:
        if device_index is not None:
            torch.cuda.set_device(device_index)
        elif backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
    except Exception:  # report, then exit: the parent turns it into RankError
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ready", None))
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        clear_breadcrumb()
        try:
            results.put((rank, "ok", fn(rank, world_size, *args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """W spawned ranks (gloo by default) that run jobs until closed.  Use as a context manager::

        # ranks.py
        import tpfuse
        from tpfuse.spawn import RankPool

        def job(rank, world_size, m):            # module level: the ranks import it by name
            x = torch.randn(m // world_size, 8)
            return tpfuse.ag_gemm(x, torch.randn(8, 4)).shape

        if __name__ == "__main__":               # each rank imports this file: guard the launch
            with RankPool(2) as pool:
                shapes = pool.run(job, 64)       # job(rank, 2, 64) on every rank; results by rank

    ``fn`` is sent by reference (module and name), so it must be a module-level function of an
    importable module or of the script's ``__main__`` (not a lambda or a nested function).  Each
    rank has its process group initialized (``dist.group.WORLD`` = the W ranks).  ``env``: extra
    environment variables on the ranks (e.g. ``{"TPFUSE_DEBUG": "0"}``).  ``device``: None (gloo:
    CPU; nccl: rank r on GPU r) or ``"cuda:N"``: every rank on GPU N with a gloo group and
    symmetric memory allowed across the ranks (``shared_device_env``).
    """

    def __init__(self, world_size: int, *, env: dict[str, str] | None = None, start_timeout: float = 120.0,
                 pg_timeout_s: float = 120.0, backend: str = "gloo", device: str | None = None):
        if world_size < 1:
            raise ValueError(f"world_size: {world_size} must be >= 1")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: {backend!r} is not supported; use 'gloo' (CPU) or 'nccl' (one GPU per rank)")
        device_index = _parse_device(device, backend)
        self.world_size = world_size
        self.device = None if device_index is None else f"cuda:{device_index}"
        self._crumbs = tempfile.mkdtemp(prefix="tpfuse-ranks-")
        ctx = mp.get_context("spawn")
        full_env = {"TPFUSE_BREADCRUMBS": self._crumbs, "OMP_NUM_THREADS": "1", **shared_device_env(device_index),
                    **(env or {})}
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, full_env, self._jobs[r], self._results, pg_timeout_s, backend,
                                                  device_index),
                        daemon=True, name=f"tpfuse-rank{r}")
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", start_timeout, "starting the process group")

    # -- running jobs -------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return results by rank."""
        if not self.alive:
            raise RuntimeError("this RankPool was closed (or killed after a timeout); create a new one")
        for q in self._jobs:
            q.put((fn, args, kwargs))
        return self._collect("ok", timeout, getattr(fn, "__name__", repr(fn)))

    def _collect(self, expect: str, timeout: float, what: str) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(results) + len(failures) < self.world_size:
            try:
                rank, status, payload = self._results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in results and r not in failures]
                if dead:
                    failures.update({r: f"process exited with code {self._procs[r].exitcode}" for r in dead})
                    continue
                if time.monotonic() >= deadline:
                    hung = [r for r in range(self.world_size) if r not in results and r not in failures]
                    crumbs = {r: self._last_step(r) for r in hung}
                    self.kill()
                    detail = "; ".join(f"rank {r} last did: {crumbs[r]}" for r in hung)
                    failed = f" (rank(s) {sorted(failures)} had raised first)" if failures else ""
                    raise TimeoutError(f"{what}: rank(s) {hung} did not finish within {timeout:.0f} s{failed}; {detail}")
                continue
            if status == "error":
                failures[rank] = payload
            else:
                results[rank] = payload
        if failures:
            if expect == "ready":
                self.kill()
            raise RankError(failures)
        return [results[r] for r in range(self.world_size)]

    def _last_step(self, rank: int) -> str:
        try:
            with open(os.path.join(self._crumbs, f"rank{rank}.txt")) as f:
                step = f.read().strip()
        except OSError:
            step = ""
        return repr(step) if step else "nothing recorded in this job"

    # -- life cycle ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self, timeout: float = 10.0) -> None:
        """Ask every rank to leave; kill those that do not within ``timeout`` seconds."""
        if self._procs and self.alive:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout)
        self.kill()

    def kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        self._procs = []
        shutil.rmtree(self._crumbs, ignore_errors=True)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              env: dict[str, str] | None = None, backend: str = "gloo", device: str | None = None,
              **kwargs: Any) -> list[Any]:
    """One job on a fresh pool of ``world_size`` ranks: ``fn(rank, world_size, *args)``."""
    with RankPool(world_size, env=env, backend=backend, device=device) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
