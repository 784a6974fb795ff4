"""What the workspace tests under TRITON_INTERPRET=1 share (tests/cpu/test_symm.py,
tests/cpu/test_fused_interp.py, ...): the interpreter switched on around a module, with its kernel
modules decorated afresh, and short spin bounds; CUDA streams faked on a CPU device
(tests/cpu/test_async_errors.py, test_host_overhead.py, test_sm_workers_interp.py); rank 0 of a
group whose rank 1 is dead."""
from __future__ import annotations

import contextlib
import os
import sys

import tpfuse.kernels
from tpfuse import symm
from tpfuse.gemm import device

KERNELS = ("tpfuse.kernels.gemm", "tpfuse.kernels.signals", "tpfuse.kernels.tile_records", "tpfuse.kernels.flags",
           "tpfuse.kernels.reduce")


def _drop_kernels() -> None:
    # also the package's attribute: ``from ..kernels import gemm`` (triton_modules) takes it over
    # sys.modules, so a module a compile test imported since would come back
    for name in KERNELS:
        sys.modules.pop(name, None)
        vars(tpfuse.kernels).pop(name.rpartition(".")[2], None)
    device.triton_modules.cache_clear()


@contextlib.contextmanager
def interpreted():
    """TRITON_INTERPRET=1 and TPFUSE_TIMEOUT_S=0.05 (the interpreter spins ~1 ms a round) inside;
    the environment as it was, and the kernels dropped, after."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["TPFUSE_TIMEOUT_S"] = "0.05"
    symm.refresh_settings()
    _drop_kernels()
    try:
        yield
    finally:
        os.environ.pop("TPFUSE_TIMEOUT_S", None)
        symm.refresh_settings()
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
        _drop_kernels()


def fake_ranks(world_size: int, capacity: int, dtype, op: str = "gemm_rs") -> list:
    """One Workspace per rank over CPU buffers standing in for the ranks' allocations."""
    import torch

    buffers = [torch.zeros(symm.FLAG_BYTES + capacity, dtype=torch.uint8) for _ in range(world_size)]
    return [symm.Workspace(symm.WorkspaceSpec("g", op, dtype, torch.device("cpu"), r, world_size, capacity), buffers)
            for r in range(world_size)]


def fake_cuda_streams(monkeypatch) -> None:
    """CUDA streams faked on a CPU device: one "stream" (waits do nothing, ``torch.cuda.stream``
    is a null context), events that record nothing, never capturing, ``record_stream`` a no-op,
    and every Workspace's side stream that same fake stream."""
    import torch

    class Stream:
        def wait_stream(self, s): pass

        def wait_event(self, e): pass

    class Event:
        def record(self, s=None): pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)
    monkeypatch.setattr(symm.Workspace, "stream", property(lambda self: Stream()))


def dead_peer_workspaces(monkeypatch) -> tuple[dict, list]:
    """Rank 0's half of a 2-rank group whose rank 1 never comes: ``symm.get_workspace`` hands out
    (and registers as live) rank 0 of ``fake_ranks(2, ...)``, one per op, and the host record reads
    as not failed until the test sets ``checking[0] = True`` (the interpreter runs each kernel
    before the host goes on: on a GPU the second call is queued before the first times out; the
    group check also waits for it).  Returns ``(made, checking)``: the workspaces by op (clear it
    after ``release_workspaces``) and the switch."""
    from tpfuse import watchdog

    made: dict = {}
    checking = [False]

    def get_workspace(ctx, op_name, dtype, device, need):
        if checking[0]:
            symm.check_group(ctx.group_name, op_name)
        if op_name not in made:
            made[op_name] = fake_ranks(2, max(need, 4096) * 2, dtype, op_name)[0]
            symm._LIVE[(ctx.group_name, op_name, dtype, device)] = made[op_name]
        return made[op_name]

    monkeypatch.setattr(symm, "get_workspace", get_workspace)
    real_failed = watchdog.HostRecord.failed
    monkeypatch.setattr(watchdog.HostRecord, "failed", lambda self: checking[0] and real_failed(self))
    return made, checking
