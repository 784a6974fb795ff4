"""Compile specs of the Triton GEMM family (``tpfuse/kernels/gemm.py``): typed, frozen, hashable.

:class:`CompileSpec` holds every constexpr a launch plan decides; :meth:`CompileSpec.project`
keeps the ones the variant it needs takes -- :class:`PersistentSpec` (``gemm_kernel``),
:class:`StreamKSpec` (``gemm_sk_kernel``), :class:`HookedSpec` (``gemm_hooked_kernel``) -- so a
projected spec names its kernel, is that kernel's part of the compiled-kernel cache key, and
gives the kernel its constexprs by name (:meth:`PersistentSpec.constexprs`). Field names are
the kernels' constexpr names. No Triton at import: ``C_DTYPE`` is a Triton type name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["CompileSpec", "PersistentSpec", "StreamKSpec", "HookedSpec"]


@dataclass(frozen=True)
class PersistentSpec:
    """Constexprs of ``gemm_kernel`` (plain persistent) and of ``gemm_sk_kernel``."""
    KERNEL: ClassVar[str] = "gemm_kernel"
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    EPI_SUBTILE: int
    TILE_ORDER: int
    USE_TMA: bool
    TMA_STORE: bool
    B_KMAJOR: bool
    C_DTYPE: str          # Triton type name of the output ("bfloat16", ...)
    SCALE_A: int          # kernels/_types.py SCALE_*
    SCALE_B: int
    FLATTEN: bool
    DOT_FP32: bool        # the interpreter's exact dot (fp32 tiles)
    USE_ASM: bool         # inline PTX (hooks' signals, the per-tile clock)
    RECORD_TILES: bool

    def constexprs(self, tl) -> dict:
        """``{name: value}`` for the kernel, ``C_DTYPE`` as ``tl``'s type."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["C_DTYPE"] = getattr(tl, self.C_DTYPE)
        return d


@dataclass(frozen=True)
class StreamKSpec(PersistentSpec):
    """Constexprs of ``gemm_sk_kernel``: the plain ones (stream-K is a runtime tile count)."""
    KERNEL: ClassVar[str] = "gemm_sk_kernel"


@dataclass(frozen=True)
class HookedSpec(PersistentSpec):
    """Constexprs of ``gemm_hooked_kernel``: the plain ones, stream-K and the hooks."""
    KERNEL: ClassVar[str] = "gemm_hooked_kernel"
    STREAM_K: bool
    WAIT: bool
    EPILOGUE: int         # epilogue hook: 0 off, abi.EPI_SIGNALLED, abi.EPI_ROUTE (no signals)
    DEST_ALIGNED: int     # epilogue hook: the destinations' common alignment in elements (0: none)
    EPI_TMA: int          # epilogue hook's TMA descriptors (abi.EPI_TMA_*)
    EPI_COUNT: int        # epilogue hook's count mode (abi.EPI_COUNT_*)


@dataclass(frozen=True)
class CompileSpec(HookedSpec):
    """Everything a launch plan decides for the Triton GEMM family; :meth:`project` picks the
    variant: hooks -> :class:`HookedSpec`, else stream-K -> :class:`StreamKSpec`, else
    :class:`PersistentSpec`."""
    KERNEL: ClassVar[str] = ""

    def project(self) -> PersistentSpec:
        cls = (HookedSpec if self.WAIT or self.EPILOGUE else StreamKSpec if self.STREAM_K else PersistentSpec)
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})
