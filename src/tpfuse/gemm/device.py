"""Lazy probes of the device and of Triton: nothing here runs at import time.

Device properties are ``functools.lru_cache``-d per device index (STYLE §2); Triton and the
kernel module are imported on first use, so importing :mod:`tpfuse.gemm` needs neither a GPU
nor Triton.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

__all__ = ["interpreting", "device_info", "device_index", "num_sms", "triton_modules", "warn_once"]

# Persistent programs under TRITON_INTERPRET=1: a few, so every program loops over several tiles.
INTERPRETER_PROGRAMS = 4


def interpreting() -> bool:
    """``TRITON_INTERPRET=1``: Triton's own switch, read where it decides what runs."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def device_info(index: int) -> dict:
    """``{"name", "num_sms", "capability", "smem_per_block"}`` of CUDA device ``index`` (cached;
    ``smem_per_block``: the shared memory one program may opt in to, None where torch does not
    say)."""
    p = torch.cuda.get_device_properties(index)
    return {"name": p.name, "num_sms": p.multi_processor_count, "capability": (p.major, p.minor),
            "smem_per_block": getattr(p, "shared_memory_per_block_optin", None)}


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device (the default persistent grid); a few programs under the interpreter."""
    if device.type == "cuda":
        return device_info(device_index(device))["num_sms"]
    return INTERPRETER_PROGRAMS


@functools.lru_cache(maxsize=None)
def triton_modules():
    """``(triton, triton.language, tpfuse.kernels.gemm)``, imported on first use."""
    try:
        import triton
        import triton.language as tl
        from ..kernels import gemm as kernel_module
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(f"tpfuse.gemm needs triton (pip install 'tpfuse[triton]'): {e}") from e
    return triton, tl, kernel_module


@functools.lru_cache(maxsize=None)
def warn_once(msg: str) -> None:
    warnings.warn(msg, stacklevel=3)
