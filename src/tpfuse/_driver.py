"""Two CUDA driver calls made directly (``ctypes``) on the eager path: a flat device-to-device
copy (``cuMemcpyAsync``) and a 32-bit stream write (``cuStreamWriteValue32``).

Why: on the one-GPU bed's host a ``Tensor.copy_`` between two contiguous CUDA tensors cost
20-25 us of host time per call and ``stream_write_value32`` ~10 us (cProfile of eager calls,
issue 34), for what ends in one driver call each: torch's copy walks the dispatcher, builds a
TensorIterator, takes device guards and checks peer access first.  Called here they cost a
ctypes call (~1-2 us) plus the driver's own time.  The work enqueued is the same: torch's copy of
two contiguous same-dtype tensors of one device is a ``cudaMemcpyAsync`` of their bytes on the
current stream (a CUDA graph captures either as one memcpy node), and torch's
``stream_write_value32`` is ``cuStreamWriteValue32_v2`` with no flags.

A plan's copies and words (:class:`RowCopies`, :class:`Words`) are checked once, when the plan is
built, so that an eager call pays one ``data_ptr()`` and one driver call per copy: the checks
of :func:`copy_` (about a dozen tensor attribute calls) cost ~5-10 us per copy on the bed's host.

Anything else -- another device than the current one, non-contiguous or mismatched tensors, a
driver that cannot be loaded, a call that fails -- takes torch's own path (the first failure
other than a missing context also turns the direct path off for the process, with a warning).
"""
from __future__ import annotations

import ctypes
import warnings

import torch

__all__ = ["copy_", "write_value32", "available", "RowCopies", "Words"]

_CUDA_ERROR_INVALID_CONTEXT = 201   # a thread with no current context: torch's path sets one


class _Calls:
    """The two driver entry points, with their C signatures."""

    def __init__(self, lib):
        self.memcpy = lib.cuMemcpyAsync
        self.memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.memcpy.restype = ctypes.c_int
        write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        write.restype = ctypes.c_int
        self.write32 = write


_STATE: list = [None]   # [None: not loaded yet | False: off | _Calls]


def _calls() -> _Calls | None:
    calls = _STATE[0]
    if calls is None:
        try:
            calls = _Calls(ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            calls = False
        _STATE[0] = calls
    return calls or None


def available() -> bool:
    """Whether the direct driver calls are in use in this process."""
    return _calls() is not None


def _failed(what: str, code: int) -> None:
    if code != _CUDA_ERROR_INVALID_CONTEXT:
        _STATE[0] = False
        warnings.warn(f"tpfuse: the direct {what} returned CUDA error {code}; using torch's path from now on",
                      RuntimeWarning, stacklevel=3)


def _device_index(t: torch.Tensor) -> int:
    """The current CUDA device's index if ``t`` lives on it, else -1."""
    if not t.is_cuda:
        return -1
    index = t.get_device()
    return index if index == torch._C._cuda_getDevice() else -1


def _stream(index: int) -> int:
    """The current stream of device ``index`` (a ``CUstream``)."""
    return torch._C._cuda_getCurrentRawStream(index)


def copy_(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
    """``dst.copy_(src)`` on ``stream`` (None: the current stream, which stays current either
    way); one ``cuMemcpyAsync`` of the bytes where both are contiguous CUDA tensors of the
    current device with one dtype and shape."""
    calls = _calls()
    if (calls is not None and dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous()
            and src.is_contiguous()):
        index = _device_index(dst)
        if index >= 0 and _device_index(src) == index:
            nbytes = dst.numel() * dst.element_size()
            if nbytes == 0:
                return
            code = calls.memcpy(dst.data_ptr(), src.data_ptr(), nbytes,
                                _stream(index) if stream is None else stream.cuda_stream)
            if code == 0:
                return
            _failed("cuMemcpyAsync", code)
    if stream is None:
        dst.copy_(src)
    else:
        with torch.cuda.stream(stream):
            dst.copy_(src)


def write_value32(words: torch.Tensor, index: int, value: int) -> None:
    """``words[index] = value`` (a contiguous int32/uint32 CUDA tensor) on the current stream as a
    stream memory operation (no SM): ``cuStreamWriteValue32``, or torch's symmetric-memory op."""
    calls = _calls()
    if calls is not None and words.element_size() == 4 and words.is_contiguous():
        device = _device_index(words)
        if device >= 0:
            code = calls.write32(_stream(device), words.data_ptr() + 4 * index, value, 0)
            if code == 0:
                return
            _failed("cuStreamWriteValue32", code)
    from torch.distributed._symmetric_memory import _SymmetricMemory

    _SymmetricMemory.stream_write_value32(words.view(torch.uint32), index, value)


class RowCopies:
    """A plan's copies between row ranges of a tensor made per call (``var``: the same shape,
    dtype and device every call) and tensors that outlive the calls (``fixed``: a workspace's
    slots), checked once: ``pieces`` = ``(lo, hi, fixed)``, each ``fixed`` of shape
    ``(hi - lo, *row_shape)``; ``into``: ``var[lo:hi] <- fixed`` (pulls), else
    ``fixed <- var[lo:hi]`` (pushes).  Per call :meth:`bind` checks ``var`` once and
    :meth:`copy` issues piece ``i`` as one ``cuMemcpyAsync`` on ``stream``; where the direct path
    does not apply (not CUDA, a strided or mismatched ``var``, another current device, no
    driver), :meth:`copy` is :func:`copy_` of the piece's views, on ``stream``."""

    def __init__(self, pieces, *, into: bool, row_shape: tuple[int, ...], dtype: torch.dtype):
        self.pieces = [(lo, hi, fixed) for lo, hi, fixed in pieces]
        self.into = into
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.rows = max((hi for _, hi, _ in self.pieces), default=0)
        row_bytes = dtype.itemsize
        for d in self.row_shape:
            row_bytes *= d
        fixed_ok = [f.dtype == dtype and tuple(f.shape) == (hi - lo, *self.row_shape) and f.is_contiguous()
                    and f.is_cuda for lo, hi, f in self.pieces]
        devices = {f.get_device() for _, _, f in self.pieces if f.is_cuda}
        self.index = devices.pop() if len(devices) == 1 and all(fixed_ok) else -1
        self.raw = [(lo * row_bytes, f.data_ptr(), (hi - lo) * row_bytes) for lo, hi, f in self.pieces]
        if self.index >= 0 and _calls() is None:
            self.index = -1

    def bind(self, var: torch.Tensor) -> int:
        """``var``'s address where the pieces can be copied by the driver directly, else 0."""
        # get_device() is -1 on the CPU; the driver, once turned off, is refused by copy()
        if (self.index < 0 or var.dtype != self.dtype or var.get_device() != self.index or var.shape[0] < self.rows
                or var.shape[1:] != self.row_shape or not var.is_contiguous()
                or torch._C._cuda_getDevice() != self.index):
            return 0
        return var.data_ptr()

    def copy(self, i: int, var: torch.Tensor, base: int, stream: torch.cuda.Stream) -> None:
        """Piece ``i`` between ``var`` (``base``: :meth:`bind`'s answer for it) and its fixed
        tensor, on ``stream``."""
        calls = _STATE[0]
        if base and calls:
            offset, ptr, nbytes = self.raw[i]
            if nbytes == 0:
                return
            code = (calls.memcpy(base + offset, ptr, nbytes, stream.cuda_stream) if self.into
                    else calls.memcpy(ptr, base + offset, nbytes, stream.cuda_stream))
            if code == 0:
                return
            _failed("cuMemcpyAsync", code)
        lo, hi, fixed = self.pieces[i]
        if self.into:
            copy_(var[lo:hi], fixed, stream=stream)
        else:
            copy_(fixed, var[lo:hi], stream=stream)


class Words:
    """A plan's int32 words (a contiguous CUDA tensor that outlives the calls), checked once:
    :meth:`set` is ``words[index] = value`` on ``stream`` as one ``cuStreamWriteValue32``, or
    :func:`write_value32` (on ``stream``) where the direct path does not apply."""

    def __init__(self, words: torch.Tensor):
        self.words = words
        ok = words.is_cuda and words.element_size() == 4 and words.is_contiguous()
        self.index = words.get_device() if ok else -1
        self.base = words.data_ptr()
        self.count = words.numel()

    def set(self, index: int, stream: torch.cuda.Stream, value: int = 1) -> None:
        if not 0 <= index < self.count:
            raise IndexError(f"word {index} of {self.count}")
        calls = _STATE[0]
        if calls and self.index >= 0 and torch._C._cuda_getDevice() == self.index:
            code = calls.write32(stream.cuda_stream, self.base + 4 * index, value, 0)
            if code == 0:
                return
            _failed("cuStreamWriteValue32", code)
        with torch.cuda.stream(stream):
            write_value32(self.words, index, value)
