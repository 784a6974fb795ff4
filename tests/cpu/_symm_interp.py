"""What the workspace tests under TRITON_INTERPRET=1 share (tests/cpu/test_symm.py,
tests/cpu/test_fused_interp.py): the interpreter switched on around a module, with its kernel
modules decorated afresh, and short spin bounds."""
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
    symm.timeout_s.cache_clear()
    _drop_kernels()
    try:
        yield
    finally:
        os.environ.pop("TPFUSE_TIMEOUT_S", None)
        symm.timeout_s.cache_clear()
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
