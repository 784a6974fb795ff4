"""The tuning cache: one JSON file of the fastest config per (shape, dtype, layout of b, GPU,
torch and Triton versions) -- and, tuned apart, per hook (``"wait"``, ``"epilogue"``: the
config fastest with that hook, which the fused strategies' calls carry) -- written by
:func:`tpfuse.gemm.tune` and read when a plan is made.

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

__all__ = ["cache_path", "lookup", "store", "HOOKS"]

# the hooks a config is tuned apart for (a call with the wait hook reads the "wait" entry, one
# with the epilogue hook, signalled or not, the "epilogue" entry; without one: the plain entry)
HOOKS = ("wait", "epilogue")


def cache_path() -> Path:
    root = os.environ.get("TPFUSE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tpfuse")
    return Path(root) / "gemm_core.json"


def cache_key(m, n, k, dtype, b_kmajor, gpu, hook: Optional[str] = None) -> str:
    if hook is not None and hook not in HOOKS:
        raise ValueError(f"tuning cache: hook={hook!r}; choose one of {HOOKS} or None")
    triton, _, _ = triton_modules()
    return (f"{m}x{n}x{k}|{str(dtype).replace('torch.', '')}|b={'kmajor' if b_kmajor else 'nmajor'}"
            f"|{gpu}|torch={torch.__version__}|triton={triton.__version__}" + (f"|hook={hook}" if hook else ""))


def _load() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def lookup(m, n, k, dtype, b_kmajor, device, hook: Optional[str] = None) -> Optional[GemmConfig]:
    """The cached config of this shape on this GPU (``hook``: the one tuned with that hook, no
    fallback), or None (off CUDA: always None)."""
    if device.type != "cuda":
        return None
    entry = _load().get(cache_key(m, n, k, dtype, b_kmajor, device_info(device_index(device))["name"], hook))
    if not entry:
        return None
    try:
        return GemmConfig.from_dict(entry["config"])
    except (TypeError, ValueError, KeyError) as e:   # written by another tpfuse version
        warn_once(f"tpfuse.gemm: ignoring tuning-cache entry for {m}x{n}x{k} in {cache_path()} ({e}); "
                  "re-run tune() to replace it")
        return None


def store(m, n, k, dtype, b_kmajor, device, config: Optional[GemmConfig], ms: float = 0.0,
          hook: Optional[str] = None, **info) -> None:
    """Write ``config`` as the entry of this shape (``hook``: of its calls with that hook), with
    ``info`` beside it, or (``config`` None) remove that entry (atomically: a temporary file,
    then a rename)."""
    p = cache_path()
    data = _load()
    key = cache_key(m, n, k, dtype, b_kmajor, device_info(device_index(device))["name"], hook)
    if config is None:
        if key not in data:
            return
        del data[key]
    else:
        data[key] = {"config": config.to_dict(), "ms": ms, **info}
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(p)
