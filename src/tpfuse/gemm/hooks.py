"""The GEMM core's hooks: what a fused strategy hands :func:`tpfuse.gemm.matmul`.

* :class:`WaitSpec` (consumer, AG): a tile waits until ``signal[c] >= generation`` for every
  chunk ``c`` its A rows touch; a bounded spin that records a timeout in an error word.
* :class:`EpilogueSpec` (producer, RS): rows of chunk ``c`` go to that chunk's destination;
  once every tile touching chunk ``c`` is stored, ``*signal_ptrs[c] = generation`` is published
  (a spec without signals routes only: nothing counted or published).
* :func:`new_error_word` / :func:`check_error_word`: the error word a timed-out wait fills in
  (layout in ``tpfuse/kernels/abi.py``) and the ``TimeoutError`` raised from it.

Signals carry generations (DESIGN.md §3): nothing is zeroed between calls.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..kernels import abi

__all__ = ["WaitSpec", "EpilogueSpec", "new_error_word", "check_error_word", "stacked_dests",
           "ERROR_WORDS", "MAX_GENERATION"]

ERROR_WORDS = abi.ERROR_WORDS
MAX_GENERATION = 2**31 - 1   # signals are int32


@dataclass(frozen=True)
class WaitSpec:
    """Consumer hook: a tile waits until ``signal[c] >= generation`` for every chunk ``c`` its
    A rows touch, before loading them.

    ``signal``: int32 ``[num_chunks]`` (or longer) on a's device, e.g. a symmetric signal pad.
    ``error``: int32 ``[ERROR_WORDS]`` zeroed error word (see :func:`new_error_word`); None
    allocates one per call. ``timeout_ns`` bounds the spin on GPU (%globaltimer);
    ``max_spins`` bounds it where inline PTX is not available (``TRITON_INTERPRET=1``).
    ``rank`` only labels the TimeoutError.
    """
    signal: torch.Tensor
    generation: int
    chunk_m: int
    timeout_ns: int = 10_000_000_000
    max_spins: int = 100_000
    error: Optional[torch.Tensor] = None
    rank: Optional[int] = None


@dataclass(frozen=True)
class EpilogueSpec:
    """Producer hook: rows of chunk ``c`` go to that chunk's destination (row ``r`` of ``a @ b``
    lands in row ``r - c*chunk_m`` of a ``[>= chunk rows, N]`` buffer with row stride
    ``dest_stride`` elements and unit column stride); once every tile touching chunk ``c`` is
    stored, the kernel publishes ``*signal_ptrs[c] = generation`` (release, system scope).
    Without signals (``signal_ptrs`` and ``counters`` None, ``from_tensors(dests, None, ...)``)
    the hook only routes the rows: no count, no fence, no publication -- for a caller that
    learns of the rows another way (the fused GEMM+RS/AR raise READY after the launch), at the
    cost of the plain stores.

    ``base``: any tensor of the output dtype on a's device; destinations are addressed from it.
    ``dest_offsets``: int64 ``[num_chunks]`` element offsets of each destination from
    ``base.data_ptr()`` (peer buffers in the fused strategies). ``signal_ptrs``: int64
    ``[num_chunks]`` addresses of int32 signal words, or None. ``counters``: int32
    ``[num_chunks]`` zeros, left at zero by every completed launch, or None (no signals).
    ``align_elems``: elements per 16 bytes when every destination and the row stride are
    16-byte aligned (vector stores), else 0. ``dests``: the
    destination tensors, one per chunk, when known (:meth:`from_tensors` keeps them): with them,
    16-byte alignment, at most 8 chunks and ``chunk_m`` a multiple of the tile height, a
    TMA-path launch stores each tile through a TMA descriptor per destination instead of
    pointer stores; destinations that are consecutive row blocks of one tensor (``out[c *
    chunk_m:]`` slices) take one descriptor for all chunks, whatever their number and height
    (``GemmOptions(epi_tma=False)`` turns both off).
    Build one with :meth:`from_tensors`; for the next call, :meth:`with_generation`.
    """
    base: torch.Tensor
    dest_offsets: torch.Tensor
    signal_ptrs: Optional[torch.Tensor]
    counters: Optional[torch.Tensor]
    generation: int
    chunk_m: int
    dest_stride: int
    align_elems: int = 0
    keepalive: tuple = ()
    dests: tuple = ()

    @classmethod
    def from_tensors(cls, dests: Sequence[torch.Tensor], signals: torch.Tensor | Sequence[torch.Tensor] | None,
                     generation: int, chunk_m: int,
                     counters: Optional[torch.Tensor] = None) -> "EpilogueSpec":
        """``dests[c]``: ``[rows >= chunk rows, N]`` tensor for chunk ``c``; ``signals``: an int32
        ``[num_chunks]`` tensor (signal ``c`` = ``signals[c]``), one int32 tensor per chunk
        (its first element is the signal), or None: route only, publish nothing (``generation``
        is then not used; pass 1)."""
        if len(dests) == 0:
            raise ValueError("EpilogueSpec.from_tensors: dests is empty; pass one tensor per chunk")
        stride = dests[0].stride(0)
        for i, d in enumerate(dests):
            if d.dim() != 2 or d.stride(1) != 1 or d.stride(0) != stride or d.dtype != dests[0].dtype:
                raise ValueError(f"EpilogueSpec.from_tensors: dests[{i}] is {d.dtype} {tuple(d.shape)} with strides "
                                 f"{d.stride()}; all must be 2-D {dests[0].dtype} with strides ({stride}, 1)")
        device = dests[0].device
        if signals is None:
            if counters is not None:
                raise ValueError("EpilogueSpec.from_tensors: counters without signals; pass signals, "
                                 "or neither to route the rows only")
            sig_addrs, sig_keep = None, ()
        elif isinstance(signals, torch.Tensor):
            if signals.dtype != torch.int32 or signals.numel() < len(dests):
                raise ValueError(f"EpilogueSpec.from_tensors: signals must be int32 with >= {len(dests)} "
                                 f"elements, got {signals.dtype} with {signals.numel()}")
            sig_addrs = [signals.data_ptr() + 4 * i for i in range(len(dests))]
            sig_keep = (signals,)
        else:
            if len(signals) != len(dests):
                raise ValueError(f"EpilogueSpec.from_tensors: {len(signals)} signals for {len(dests)} dests")
            sig_addrs = [s.data_ptr() for s in signals]
            sig_keep = tuple(signals)
        e = dests[0].element_size()
        origin = dests[0].data_ptr()
        offsets = [(d.data_ptr() - origin) // e for d in dests]
        aligned = all(d.data_ptr() % 16 == 0 for d in dests) and (stride * e) % 16 == 0
        if counters is None and sig_addrs is not None:
            counters = torch.zeros(len(dests), dtype=torch.int32, device=device)
        return cls(dests[0], torch.tensor(offsets, dtype=torch.int64, device=device),
                   None if sig_addrs is None else torch.tensor(sig_addrs, dtype=torch.int64, device=device), counters,
                   generation, chunk_m, stride, align_elems=16 // e if aligned else 0,
                   keepalive=tuple(dests) + sig_keep, dests=tuple(dests))

    @property
    def signalled(self) -> bool:
        """Whether the hook counts stored tiles and publishes chunks (False: it routes only)."""
        return self.signal_ptrs is not None

    def with_generation(self, generation: int) -> "EpilogueSpec":
        """The same spec for the next call: ``generation`` changed; the buffers, and what was
        derived from them once (the destinations' TMA descriptors, whether they are stacked),
        kept -- a ``dataclasses.replace`` copy would build those again on its first call."""
        new = dataclasses.replace(self, generation=generation)
        for cache in ("_tma_descs", "_stacked"):   # frozen dataclass: caches, not fields
            if cache in self.__dict__:
                new.__dict__[cache] = self.__dict__[cache]
        return new


def new_error_word(device) -> torch.Tensor:
    """A zeroed int32 error word for :class:`WaitSpec` (reuse it across calls while it stays 0)."""
    return torch.zeros(ERROR_WORDS, dtype=torch.int32, device=device)


def check_error_word(error: torch.Tensor, *, rank: Optional[int] = None,
                     timeout_ns: Optional[int] = None) -> None:
    """Raise TimeoutError if a wait hook recorded a timeout in ``error`` (synchronizes)."""
    words = error.tolist()
    if words[abi.ERR_STATUS] == abi.ERR_OK:
        return
    who = f"rank {rank}" if rank is not None else "this rank"
    bound = f" more than {timeout_ns} ns" if timeout_ns is not None else ""
    raise TimeoutError(
        f"tpfuse GEMM wait hook timed out on {who}: tile {words[abi.ERR_TILE]} (program "
        f"{words[abi.ERR_PROGRAM]}) waited{bound} for signal[chunk={words[abi.ERR_CHUNK]}] >= generation "
        f"{words[abi.ERR_GENERATION]}, last value seen {words[abi.ERR_SEEN]}. The producer of chunk "
        f"{words[abi.ERR_CHUNK]} never published this generation: a peer "
        f"rank is dead, late or on another call. Zero the error word before reusing it.")


def stacked_dests(epilogue: EpilogueSpec) -> bool:
    """True when ``epilogue.dests`` are two or more consecutive row blocks of one tensor:
    dests[c] starts ``c * chunk_m`` rows (of ``dest_stride``) after dests[0], with the same
    width (the chunks of one output buffer: a rank's own symmetric buffer, or
    ``out[c * chunk_m:]`` slices). Row r of ``a @ b`` then goes to row r from dests[0]: the very
    addresses the per-chunk descriptors would write, so where the tensors live does not matter.
    Decided once per spec, from pointers only: it is on the per-call path (the plan key)."""
    got = epilogue.__dict__.get("_stacked")   # frozen dataclass: a cache, not a field
    if got is None:
        dests = epilogue.dests
        if len(dests) > 1:
            base, width = dests[0].data_ptr(), dests[0].shape[1]
            row_bytes = epilogue.dest_stride * dests[0].element_size()
            got = all(d.data_ptr() == base + c * epilogue.chunk_m * row_bytes and d.shape[1] == width
                      for c, d in enumerate(dests))
        else:
            got = False
        epilogue.__dict__["_stacked"] = got
    return got

