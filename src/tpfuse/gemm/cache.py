"""The tuning cache: one JSON file of the fastest config per (shape, dtype, layout of b, GPU,
torch and Triton versions), written by :func:`tpfuse.gemm.tune` and read when a plan is made.

``$TPFUSE_CACHE_DIR/gemm_core.json``, else ``~/.cache/tpfuse/gemm_core.json``. Kept apart from
:mod:`tpfuse.gemm.tune` (which times candidates through :func:`tpfuse.gemm.matmul`) so that
the launch side can read it without importing the tuner: imports point down.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from .config import GemmConfig
from .device import device_index, device_info, triton_modules, warn_once

__all__ = ["cache_path", "lookup", "store"]


def cache_path() -> Path:
    root = os.environ.get("TPFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tpfuse")
    return Path(root) / "gemm_core.json"


def cache_key(m, n, k, dtype, b_kmajor, gpu) -> str:
    triton, _, _ = triton_modules()
    return (f"{m}x{n}x{k}|{str(dtype).replace('torch.', '')}|b={'kmajor' if b_kmajor else 'nmajor'}"
            f"|{gpu}|torch={torch.__version__}|triton={triton.__version__}")


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def lookup(m, n, k, dtype, b_kmajor, device) -> Optional[GemmConfig]:
    """The cached config of this shape on this GPU, or None (off CUDA: always None)."""
    if device.type != "cuda":
        return None
    entry = _load().get(cache_key(m, n, k, dtype, b_kmajor, device_info(device_index(device))["name"]))
    if not entry:
        return None
    try:
        return GemmConfig.from_dict(entry["config"])
    except (TypeError, ValueError, KeyError) as e:   # written by another tpfuse version
        warn_once(f"tpfuse.gemm: ignoring tuning-cache entry for {m}x{n}x{k} in {cache_path()} ({e}); "
                  "re-run tune() to replace it")
        return None


def store(m, n, k, dtype, b_kmajor, device, config: GemmConfig, ms: float) -> None:
    """Write ``config`` as the entry of this shape (atomically: a temporary file, then a rename)."""
    p = cache_path()
    data = _load()
    data[cache_key(m, n, k, dtype, b_kmajor, device_info(device_index(device))["name"])] = {
        "config": config.to_dict(), "ms": ms}
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(p)
