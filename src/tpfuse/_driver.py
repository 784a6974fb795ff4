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

Anything else -- another device than the current one, non-contiguous or mismatched tensors, a
driver that cannot be loaded, a call that fails -- takes torch's own path (the first failure
other than a missing context also turns the direct path off for the process, with a warning).
"""
from __future__ import annotations

import ctypes
import warnings

import torch

__all__ = ["copy_", "write_value32", "available"]

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
