"""tpfuse/_driver.py on a GPU: the direct ``cuMemcpyAsync`` and ``cuStreamWriteValue32`` do what
torch's ``copy_`` and ``stream_write_value32`` do -- bytes equal, on the stream asked for (ordered
after work queued there first), captured by a CUDA graph and replayed with new data -- and the
process keeps the direct path (no failure turned it off).  tests/cpu/test_driver.py checks the
arguments and every fallback with a fake driver."""
from __future__ import annotations

import pytest
import torch

from tpfuse import _driver

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8])
def test_a_direct_copy_is_torchs_copy_bit_for_bit(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(0, 256, (37, 1000), generator=g, device="cuda", dtype=torch.uint8).view(dtype)
    if dtype.itemsize > 1:
        src = torch.randn(37, 1000 // dtype.itemsize, generator=g, device="cuda").to(dtype)
    big = torch.zeros(64, src.shape[1], device="cuda", dtype=dtype)
    dst = big[5:42]                                     # contiguous rows at an offset
    _driver.copy_(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    assert not big[:5].view(torch.uint8).any() and not big[42:].view(torch.uint8).any()
    assert _driver.available()


def test_a_direct_copy_runs_on_the_stream_it_is_given_after_its_queued_work():
    side = torch.cuda.Stream()
    src = torch.full((1 << 20,), 3.0, device="cuda")
    dst = torch.zeros_like(src)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)      # the side stream busy first: the copy must wait for it
        src.fill_(7.0)
    _driver.copy_(dst, src, stream=side)   # the current stream stays the default one
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    side.synchronize()
    assert bool((dst == 7.0).all())


def test_a_direct_copy_and_stream_write_replay_from_a_cuda_graph():
    src = torch.zeros(4096, device="cuda")
    dst = torch.zeros_like(src)
    words = torch.zeros(8, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        _driver.copy_(dst, src)            # warm: the driver loaded outside the capture
        with torch.cuda.graph(graph, stream=side):
            _driver.copy_(dst, src)
            _driver.write_value32(words, 5, 1)
    torch.cuda.current_stream().wait_stream(side)
    for value in (1.0, 2.0):
        src.fill_(value)
        words.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert bool((dst == value).all()) and words.tolist() == [0, 0, 0, 0, 0, 1, 0, 0]


def test_a_direct_stream_write_is_torchs_stream_write():
    from torch.distributed._symmetric_memory import _SymmetricMemory

    ours = torch.zeros(16, dtype=torch.int32, device="cuda")
    theirs = torch.zeros_like(ours)
    for i in (0, 3, 15):
        _driver.write_value32(ours, i, 1)
        _SymmetricMemory.stream_write_value32(theirs.view(torch.uint32), i, 1)
    torch.cuda.synchronize()
    assert torch.equal(ours, theirs) and ours.sum().item() == 3 and _driver.available()


def test_a_plans_row_copies_and_words_are_torchs_copies_on_the_stream_given_and_in_a_graph():
    """RowCopies / Words (a plan's pulls, pushes and arrival words, checked once): bytes equal to
    torch's copies of the same rows, both directions, on the side stream given (after its queued
    work), and replayed from a CUDA graph with new data."""
    g = torch.Generator(device="cuda").manual_seed(1)
    slots = [torch.randn(r, 1000, generator=g, device="cuda").to(torch.bfloat16) for r in (37, 5)]
    pulls = _driver.RowCopies([(3, 40, slots[0]), (50, 55, slots[1])], into=True, row_shape=(1000,),
                              dtype=torch.bfloat16)
    words = _driver.Words(torch.zeros(4, dtype=torch.int32, device="cuda"))
    side = torch.cuda.Stream()
    var = torch.zeros(60, 1000, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
    base = pulls.bind(var)
    assert base == var.data_ptr()
    for i in range(2):
        pulls.copy(i, var, base, side)
    words.set(2, side)
    side.synchronize()
    assert torch.equal(var[3:40], slots[0]) and torch.equal(var[50:55], slots[1])
    assert not var[:3].any() and not var[40:50].any() and not var[55:].any()
    assert words.words.tolist() == [0, 0, 1, 0]
    out = [torch.zeros_like(s) for s in slots]
    pushes = _driver.RowCopies([(3, 40, out[0]), (50, 55, out[1])], into=False, row_shape=(1000,), dtype=torch.bfloat16)
    source = torch.randn(60, 1000, generator=g, device="cuda").to(torch.bfloat16)
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            b = pushes.bind(source)
            for i in range(2):
                pushes.copy(i, source, b, side)
            words.set(0, side)
    torch.cuda.current_stream().wait_stream(side)
    for value in (1.0, 2.0):
        source.fill_(value)
        words.words.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(bool((o == value).all()) for o in out) and words.words.tolist() == [1, 0, 0, 0]
    assert _driver.available()
