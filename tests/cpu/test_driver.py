"""tpfuse/_driver.py: the eager path's direct driver calls (issue 34), with a fake driver: what
``cuMemcpyAsync`` and ``cuStreamWriteValue32`` are called with, and every case that takes torch's
own path instead (another device, strided or mismatched tensors, an unloadable driver, a failed
call: the first failure other than a missing context turns the direct path off)."""
from __future__ import annotations

import pytest
import torch

from tpfuse import _driver


class FakeDriver:
    def __init__(self, code: int = 0):
        self.code = code
        self.calls = []

    def memcpy(self, dst, src, nbytes, stream):
        self.calls.append(("memcpy", dst, src, nbytes, stream))
        return self.code

    def write32(self, stream, addr, value, flags):
        self.calls.append(("write32", stream, addr, value, flags))
        return self.code


@pytest.fixture
def fake(monkeypatch):
    """The driver faked, every CPU tensor treated as one on the current CUDA device (index 0),
    whose current stream is 77."""
    driver = FakeDriver()
    monkeypatch.setattr(_driver, "_STATE", [driver])
    monkeypatch.setattr(_driver, "_device_index", lambda t: 0)
    monkeypatch.setattr(_driver, "_stream", lambda index: 77)
    return driver


def test_a_contiguous_copy_is_one_memcpy_of_its_bytes_on_the_current_stream(fake):
    src = torch.arange(12, dtype=torch.float16).view(3, 4)
    dst = torch.zeros(8, 4, dtype=torch.float16)[2:5]          # contiguous rows of a bigger tensor
    _driver.copy_(dst, src)
    assert fake.calls == [("memcpy", dst.data_ptr(), src.data_ptr(), 24, 77)]
    assert not dst.any()      # the fake driver copied nothing: the call was the driver's, not torch's
    _driver.copy_(torch.zeros(0, 4, dtype=torch.float16), src[:0])
    assert len(fake.calls) == 1    # nothing to move: no call


@pytest.mark.parametrize("case", ["strided dst", "strided src", "dtype", "other device"])
def test_anything_else_takes_torchs_copy(fake, monkeypatch, case):
    src = torch.arange(12, dtype=torch.float32).view(3, 4)
    dst = torch.zeros(3, 4)
    if case == "strided dst":
        dst = torch.zeros(3, 8)[:, ::2]
    elif case == "strided src":
        src = src.t().contiguous().t()    # same shape and values, column-major
    elif case == "dtype":
        dst = torch.zeros(3, 4, dtype=torch.float64)
    else:
        monkeypatch.setattr(_driver, "_device_index", lambda t: 0 if t is dst else 1)
    _driver.copy_(dst, src)
    assert fake.calls == [] and torch.equal(dst, src.to(dst.dtype))


def test_a_shape_mismatch_is_torchs_error_not_a_copy_of_the_bytes(fake):
    with pytest.raises(RuntimeError):
        _driver.copy_(torch.zeros(4, 3), torch.ones(3, 4))
    assert fake.calls == []


def test_a_failed_call_falls_back_and_turns_the_direct_path_off_with_a_warning(fake):
    fake.code = 1   # CUDA_ERROR_INVALID_VALUE
    src, dst = torch.ones(4), torch.zeros(4)
    with pytest.warns(RuntimeWarning, match="cuMemcpyAsync returned CUDA error 1"):
        _driver.copy_(dst, src)
    assert torch.equal(dst, src) and not _driver.available()
    dst.zero_()
    _driver.copy_(dst, src)
    assert len(fake.calls) == 1 and torch.equal(dst, src)   # off: torch's copy, no second driver call


def test_a_thread_without_a_context_falls_back_and_keeps_the_direct_path(fake):
    fake.code = 201   # CUDA_ERROR_INVALID_CONTEXT: torch's call makes the context current
    src, dst = torch.ones(4), torch.zeros(4)
    _driver.copy_(dst, src)
    assert torch.equal(dst, src) and _driver.available()


def test_a_word_is_one_stream_write_at_its_address(fake):
    words = torch.zeros(6, dtype=torch.int32)
    _driver.write_value32(words, 3, 1)
    assert fake.calls == [("write32", 77, words.data_ptr() + 12, 1, 0)]


def test_no_driver_means_torchs_path(monkeypatch):
    monkeypatch.setattr(_driver, "_STATE", [None])
    monkeypatch.setattr(_driver.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    src, dst = torch.ones(3), torch.zeros(3)
    _driver.copy_(dst, src)
    assert torch.equal(dst, src) and not _driver.available()



def test_a_plans_row_copies_are_one_memcpy_each_at_the_offsets_checked_once(fake, monkeypatch):
    """RowCopies (issue 34: a plan's pulls and pushes): pieces between rows of a per-call tensor and
    fixed tensors, one memcpy each from the per-call base address, both directions, on the stream
    given; an empty piece moves nothing."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    slots = [torch.ones(r, 4, dtype=torch.float16) for r in (2, 3, 0)]
    stream = type("S", (), {"cuda_stream": 5})()
    pulls = _driver.RowCopies([(2, 4, slots[0]), (5, 8, slots[1]), (8, 8, slots[2])], into=True, row_shape=(4,),
                              dtype=torch.float16)
    var = torch.zeros(8, 4, dtype=torch.float16)
    base = pulls.bind(var)
    assert base == var.data_ptr()
    for i in range(3):
        pulls.copy(i, var, base, stream)
    assert fake.calls == [("memcpy", base + 16, slots[0].data_ptr(), 16, 5),
                          ("memcpy", base + 40, slots[1].data_ptr(), 24, 5)]
    pushes = _driver.RowCopies([(5, 8, slots[1])], into=False, row_shape=(4,), dtype=torch.float16)
    fake.calls.clear()
    pushes.copy(0, var, pushes.bind(var), stream)
    assert fake.calls == [("memcpy", slots[1].data_ptr(), base + 40, 24, 5)]


@pytest.mark.parametrize("case", ["too few rows", "dtype", "row shape", "strided", "other current device"])
def test_row_copies_of_a_tensor_that_does_not_fit_take_torchs_copy(fake, monkeypatch, case):
    """A per-call tensor the plan was not made for is never addressed raw: bind says 0 and the
    pieces go through torch's copy (a copy past the tensor's end would corrupt memory)."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1 if case == "other current device" else 0, raising=False)
    monkeypatch.setattr(_driver, "_device_index", lambda t: -1)   # copy_'s own check: torch's path
    slot = torch.arange(12, dtype=torch.float32).view(3, 4)
    pulls = _driver.RowCopies([(5, 8, slot)], into=True, row_shape=(4,), dtype=torch.float32)
    var = {"too few rows": torch.zeros(7, 4), "dtype": torch.zeros(8, 4, dtype=torch.float64),
           "row shape": torch.zeros(8, 5), "strided": torch.zeros(8, 8)[:, ::2],
           "other current device": torch.zeros(8, 4)}[case]
    base = pulls.bind(var)
    assert base == 0
    if case in ("too few rows", "row shape"):
        with pytest.raises(RuntimeError):
            pulls.copy(0, var, base, None)
    else:
        pulls.copy(0, var, base, None)
        assert torch.equal(var[5:8], slot.to(var.dtype))
    assert fake.calls == []


def test_a_plans_words_are_one_stream_write_each_and_bounded(fake, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    words = torch.zeros(6, dtype=torch.int32)
    w = _driver.Words(words)
    w.set(3, type("S", (), {"cuda_stream": 9})())
    assert fake.calls == [("write32", 9, words.data_ptr() + 12, 1, 0)]
    with pytest.raises(IndexError):
        w.set(6, None)
