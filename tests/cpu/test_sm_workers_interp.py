"""The ``sm_workers`` strategy on CPU: its worker kernel's index math, its staging ring's
queue/credit protocol on fake ranks under TRITON_INTERPRET=1 (CPU tensors stand in for the
ranks' symmetric allocations, tpfuse/symm.py), its knobs and stats, the sm_90 compile of its
kernels, and its refusal on a gloo group.  The concurrent schedule runs on the GPU bed
(tests/gpu/bed.py): here the interpreter runs kernels one after another, so each ring piece's
worker launch follows its producer (``push_partials`` on a CPU device)."""
from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

import tpfuse.kernels  # noqa: E402
from tpfuse import symm, watchdog  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402
from tpfuse.strategies import sm_workers as S  # noqa: E402

from _symm_interp import dead_peer_workspaces, fake_cuda_streams, fake_ranks, interpreted  # noqa: E402

_MODULE = "tpfuse.kernels.sm_workers"


def _drop_module() -> None:
    sys.modules.pop(_MODULE, None)
    vars(tpfuse.kernels).pop("sm_workers", None)


@contextlib.contextmanager
def _interp():
    """The shared interpreter switch, plus this strategy's kernel module decorated afresh."""
    with interpreted():
        _drop_module()
        try:
            yield
        finally:
            _drop_module()


@pytest.fixture
def interp():
    with _interp():
        yield


def _kernels():
    import importlib

    return importlib.import_module(_MODULE)


# --------------------------------------------------------------------------------------------
# the worker kernel
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("comm_sms, aligned", [(1, True), (3, True), (3, False)])
def test_worker_copy_covers_odd_sizes_exactly_and_publishes_once(interp, comm_sms, aligned):
    """Tasks of 0, 1, 127, 128, 129, 1000 and 3 x 128 + 5 elements over 1 or 3 worker
    programs (blocks of 128 elements): every element copied bit-exactly, nothing written past
    a task's end, each counter back at 0, each task's words published with const + per_gen x gen."""
    ws = fake_ranks(1, 4096, torch.float16, op="ag_gemm")[0]
    ws.gen.fill_(7)
    sizes = [0, 1, 127, 128, 129, 1000, 3 * 128 + 5]
    pad = 0 if aligned else 1                        # odd element offsets: no 16-byte vectors
    total = sum(-(-(s + 8) // 8) * 8 + pad for s in sizes)
    src = torch.randint(-2**15, 2**15 - 1, (total,), dtype=torch.int16).view(torch.float16)
    dst = torch.full((total,), -1, dtype=torch.int16).view(torch.float16)
    words = torch.zeros(2 * len(sizes), dtype=torch.int32)
    tasks, offsets, at = [], [], pad
    for i, size in enumerate(sizes):
        offsets.append(at)
        tasks.append(S.Task(src=src.data_ptr() + 2 * at, dst=2 * at, numel=size, chunk=i,
                            pub1=words.data_ptr() + 4 * i, pub1_const=i + 1,
                            pub2=words.data_ptr() + 4 * (len(sizes) + i), pub2_gen=1))
        at += -(-(size + 8) // 8) * 8 + pad          # aligned: tasks start on 16-byte boundaries
    kn = S.SmWorkersKnobs(comm_sms=comm_sms, block_bytes=256)
    launch = S._launch_tables(ws, ("test", comm_sms, aligned), lambda: tasks)
    assert launch.aligned == aligned
    S.launch_workers(ws, launch, kn, dst_base=dst.data_ptr())
    got, want = dst.view(torch.int16), src.view(torch.int16)
    for off, size in zip(offsets, sizes):
        assert torch.equal(got[off:off + size], want[off:off + size]), f"task of {size} elements"
        assert got[off + size:off + size + 8].eq(-1).all(), f"written past the end of a task of {size}"
    assert got[:pad].eq(-1).all()
    assert launch.counters.eq(0).all()
    assert words[:len(sizes)].tolist() == list(range(1, len(sizes) + 1))
    assert words[len(sizes):].eq(7).all()
    assert ws.error[0].item() == 0


def test_worker_wait_times_out_recording_rank_peer_chunk_and_generation(interp):
    """Task 1 waits for a peer's READY that never comes: the error word (abi.py's layout) and
    its host-visible record name the wait (what, peer, target generation, last seen, rank,
    chunk, program); task 1 was neither copied nor published, while tasks 0 and 2 (one block
    each, dealt to program 0; task 1 to program 1, which alone waits) were copied and published
    before the timeout; the host raises a TimeoutError naming them from the record (no device
    read) and the workspace is broken.  A launch on the broken word copies and publishes nothing."""
    ws = fake_ranks(2, 4096, torch.float16, op="ag_gemm")[1]
    ws.gen.fill_(3)
    ws.calls = 3
    flag = torch.zeros(1, dtype=torch.int32)
    flag.fill_(2)                                   # the peer is a call behind
    done = torch.zeros(3, dtype=torch.int32)
    src = torch.arange(64, dtype=torch.float16)
    dst = torch.zeros(3 * 64, dtype=torch.float16)
    tasks = [S.Task(src=src.data_ptr(), dst=dst.data_ptr() + 128 * i, numel=64, chunk=10 + i, peer=0,
                    what=symm.WAIT_READY, wait=flag.data_ptr() if i == 1 else 0, wait_gen=1,
                    pub1=done.data_ptr() + 4 * i, pub1_gen=1) for i in range(3)]
    launch = S._launch_tables(ws, ("timeout",), lambda: tasks)
    S.launch_workers(ws, launch, S.SmWorkersKnobs(comm_sms=2, block_bytes=256))
    words = ws.error.tolist()
    assert words[:7] == [1, symm.WAIT_READY, 0, 3, 2, 1, 11] and words[abi.ERR_PROGRAM] == 1
    assert ws.host.record() == words[:abi.ERR_RECORD_WORDS]
    # the interpreter runs program 0 to its end first: tasks 0 and 2 complete (their sole
    # participant), then program 1 times out on task 1
    assert torch.equal(dst[:64], src) and dst[64:128].eq(0).all() and torch.equal(dst[128:], src)
    assert done.tolist() == [3, 0, 3]
    with pytest.raises(TimeoutError, match=r"rank 1 waited .* for rank 0 to publish .*generation >= 3.*chunk 11"):
        ws.check("ag_gemm")
    assert ws.broken is not None and "broken" in ws.broken
    # queued after the timeout: every task is skipped at once, nothing copied, nothing published
    flag.fill_(3)
    dst.zero_()
    done.zero_()
    S.launch_workers(ws, launch, S.SmWorkersKnobs(comm_sms=2, block_bytes=256))
    assert dst.eq(0).all() and done.tolist() == [0, 0, 0] and ws.error.tolist() == words


@pytest.mark.parametrize("comm_sms, blocks_before, tasks_before", [(4, 1, 2), (3, 2, 4), (5, 3, 3), (2, 1, 3)])
def test_small_tasks_are_dealt_to_rotating_programs_and_only_those_wait(interp, comm_sms, blocks_before,
                                                                       tasks_before):
    """Task t's blocks are dealt from program (blocks of the tasks before t) mod G, and only
    programs with a block wait: ``tasks_before`` tasks of ``blocks_before`` blocks each (the
    last one short: sizes need not be block multiples), then a one-block task whose READY never
    comes.  Its wait is made -- and its timeout recorded -- by program (tasks_before x
    blocks_before) mod G alone (before: by every program, program 0 first), every task before
    it was copied and published by its participants, and their counters are back at 0.  (The
    cases make the waiting program the last one: the interpreter runs programs one after
    another, and one that starts after the timeout finds the workspace broken and copies nothing.)"""
    block = 128                                                    # fp16 elements of 256 bytes
    ws = fake_ranks(2, 4096, torch.float16, op="ag_gemm")[1]
    ws.gen.fill_(1)
    flag = torch.zeros(1, dtype=torch.int32)
    done = torch.zeros(tasks_before + 1, dtype=torch.int32)
    size = (blocks_before - 1) * block + 72
    src = torch.randint(-2**15, 2**15 - 1, (size,), dtype=torch.int16).view(torch.float16)
    dst = torch.zeros((tasks_before + 1) * size, dtype=torch.float16)
    tasks = [S.Task(src=src.data_ptr(), dst=dst.data_ptr() + 2 * size * i, numel=size if i < tasks_before else 1,
                    chunk=i, peer=0, what=symm.WAIT_READY, wait=flag.data_ptr() if i == tasks_before else 0,
                    wait_gen=1, pub1=done.data_ptr() + 4 * i, pub1_const=1) for i in range(tasks_before + 1)]
    launch = S._launch_tables(ws, ("dealing", comm_sms, blocks_before, tasks_before), lambda: tasks)
    S.launch_workers(ws, launch, S.SmWorkersKnobs(comm_sms=comm_sms, block_bytes=256))
    words = ws.error.tolist()
    assert words[:7] == [1, symm.WAIT_READY, 0, 1, 0, 1, tasks_before]
    assert words[abi.ERR_PROGRAM] == (tasks_before * blocks_before) % comm_sms
    for i in range(tasks_before):
        assert torch.equal(dst[i * size:(i + 1) * size].view(torch.int16), src.view(torch.int16)), f"task {i}"
    assert dst[tasks_before * size:].view(torch.int16).eq(0).all()
    assert done.tolist() == [1] * tasks_before + [0]
    assert launch.counters[:tasks_before].eq(0).all()


@pytest.mark.parametrize("comm_sms, block_bytes", [(1, 256), (3, 256), (8, 256), (40, 256), (5, 1024)])
def test_many_tiny_and_odd_tasks_are_counted_to_their_participants_and_published_once(interp, comm_sms,
                                                                                    block_bytes):
    """60 tasks of 0 .. 5 blocks and odd sizes (G above and below a task's blocks): every
    element copied, nothing past a task's end, every task's words published with its value and
    every counter back at 0 -- a completion target other than min(G, blocks) leaves a counter
    non-zero or a word unpublished."""
    g = torch.Generator().manual_seed(comm_sms)
    block = block_bytes // 2
    sizes = [0, 1, block - 1, block, block + 1] + torch.randint(0, 5 * block, (55,), generator=g).tolist()
    ws = fake_ranks(1, 4096, torch.float16, op="ag_gemm")[0]
    ws.gen.fill_(5)
    total = sum(s + 8 for s in sizes)
    src = torch.randint(-2**15, 2**15 - 1, (total,), dtype=torch.int16, generator=g).view(torch.float16)
    dst = torch.full((total,), -1, dtype=torch.int16).view(torch.float16)
    words = torch.zeros(len(sizes), dtype=torch.int32)
    tasks, offsets, at = [], [], 0
    for i, size in enumerate(sizes):
        offsets.append(at)
        tasks.append(S.Task(src=src.data_ptr() + 2 * at, dst=2 * at, numel=size, chunk=i,
                            pub1=words.data_ptr() + 4 * i, pub1_const=i, pub1_gen=1))
        at += size + 8
    launch = S._launch_tables(ws, ("tiny", comm_sms, block_bytes), lambda: tasks)
    S.launch_workers(ws, launch, S.SmWorkersKnobs(comm_sms=comm_sms, block_bytes=block_bytes),
                     dst_base=dst.data_ptr())
    got, want = dst.view(torch.int16), src.view(torch.int16)
    for off, size in zip(offsets, sizes):
        assert torch.equal(got[off:off + size], want[off:off + size]), f"task of {size} elements"
        assert got[off + size:off + size + 8].eq(-1).all(), f"written past the end of a task of {size}"
    assert words.tolist() == [i + 5 for i in range(len(sizes))]
    assert launch.counters.eq(0).all() and ws.error[0].item() == 0


@pytest.mark.parametrize("comm_sms, pushed_early", [(1, [1, 0, 0]), (2, [1, 0, 1]), (5, [1, 0, 0])])
def test_an_owners_ready_waits_for_every_piece_of_the_owner(interp, comm_sms, pushed_early):
    """gemm_rs's ring, one worker launch over all its tasks (as on the GPU): owner 1's rows in
    three one-block pieces through three slots.  With pieces 0 and 2 produced and piece 1 not,
    pieces 0 and 2 are pushed and their slots FREE, but the owner's READY -- which covers all
    its pieces -- is not published (piece 2's completion says nothing of piece 1 now that
    programs skip pieces they have no block of; at G = 2 program 0 completes piece 2 while
    piece 1, program 1's, is not done); piece 1's timeout is recorded.  All three produced:
    READY is published once, with the generation, and every counter is back at 0.  (The
    interpreter runs programs one after another: at G = 1 the one program stops at piece 1, at
    G = 5 program 2, piece 2's, starts after the timeout and copies nothing.)"""
    world_size, shard, n = 2, 48, 8
    kn = S.SmWorkersKnobs(comm_sms=comm_sms, slots=3, block_bytes=256, chunk_rows=16)   # 128 elements a piece
    bounds = [(r * shard, (r + 1) * shard) for r in range(world_size)]
    for produced in ([1, 0, 1], [1, 1, 1]):
        ws = fake_ranks(world_size, world_size * shard * n * 2, torch.float16)
        ws[0].gen.fill_(4)
        ring, launch = S._ring(ws[0], bounds, shard, n, kn)
        assert len(ring.pieces) == 3 and all(p.owner == 1 for p in ring.pieces)
        ring.buffer.copy_(torch.arange(ring.buffer.numel()).to(torch.float16))
        ring.ready.copy_(torch.tensor(produced, dtype=torch.int32))
        S.launch_workers(ws[0], launch, kn)
        ready_word = ws[0].flags[1][symm.flag_index("READY", 0, world_size)].item()
        inbox = ws[0].data(1, (shard, n), offset=0).reshape(-1)
        for j, p in enumerate(ring.pieces):
            pushed = torch.equal(inbox[p.lo * n - shard * n:p.hi * n - shard * n], ring.slot(j)[:(p.hi - p.lo) * n])
            assert pushed == bool(produced[j] if produced == [1, 1, 1] else pushed_early[j]), (j, produced)
        if produced == [1, 1, 1]:
            assert ready_word == 4 and ring.free.tolist() == [1, 1, 1] and ws[0].error[0].item() == 0
            assert launch.counters.eq(0).all()
        else:
            assert ready_word == 0, "READY published before every piece of the owner was pushed"
            assert ws[0].error.tolist()[:7] == [1, S.WAIT_SLOT_READY, 1, 1, 0, 0, 1]
            assert ring.free.tolist() == pushed_early


def test_ring_kernels_do_nothing_once_the_word_is_broken(interp):
    """A broken workspace: the producer's credit wait returns at once (no stall counted, no
    second record) and READY of a ring slot is not published."""
    ws = fake_ranks(1, 4096, torch.float16)[0]
    ws.error[abi.ERR_STATUS] = 1
    K = _kernels()
    free, ready = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    stalls, stamps = torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    K.slot_acquire_kernel[(1,)](free, 1, 1, ws.error, stalls, 10_000, 0, 1, 2, S.WAIT_SLOT_FREE, USE_ASM=False,
                                num_warps=1)
    K.slot_ready_kernel[(1,)](ready, 1, 0, stamps, 2, ws.error, USE_ASM=False, num_warps=1)
    assert stalls.tolist() == [0, 0] and ready.tolist() == [0, 0]
    assert ws.error.tolist()[:abi.ERR_RECORD_WORDS] == [1] + [0] * (abi.ERR_RECORD_WORDS - 1)


@pytest.mark.parametrize("numel, chunk_bytes, ctas", [(1000, 256, 3), (77, 4096, 2), (4096, 1024, 1),
                                                      (3001, 100, 4), (5000, 1000, 2), (5000, 1000, 7)])
def test_make_copy_the_bench_grid_copies_int32_exactly(interp, numel, chunk_bytes, ctas):
    """``tpfuse bench comm``'s sm_workers rows: the worker kernel alone, chunks of ``chunk_bytes``
    (many chunks below a block, chunks not a block multiple, CTAs above and below a chunk's blocks)."""
    src = torch.randint(-2**31, 2**31 - 1, (numel,), dtype=torch.int32)
    dst = torch.zeros(numel + 4, dtype=torch.int32)
    S.make_copy(src, dst[:numel], chunk_bytes, S.SmWorkersKnobs(comm_sms=ctas, block_bytes=256))()
    assert torch.equal(dst[:numel], src) and dst[numel:].eq(0).all()
    with pytest.raises(ValueError, match="make_copy: src and dst"):
        S.make_copy(src, dst, chunk_bytes, S.SmWorkersKnobs(comm_sms=1))


# --------------------------------------------------------------------------------------------
# the staging ring
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size, m, chunk_rows, slots", [(3, 15, None, 2), (3, 15, 2, 1), (4, 10, 1, 2),
                                                                (4, 2, None, 1), (2, 9, 4, 3)])
def test_ring_pieces_cover_every_peer_row_once_in_owner_order_and_wrap_the_slots(world_size, m, chunk_rows, slots):
    from tpfuse.strategies._symm_steps import row_bounds

    bounds = row_bounds(m, world_size)
    for rank in range(world_size):
        pieces = S.ring_pieces(rank, world_size, bounds, chunk_rows, slots)
        owners = [(rank + i) % world_size for i in range(1, world_size)]
        assert [p.owner for p in pieces] == sorted((p.owner for p in pieces), key=owners.index)
        covered = torch.zeros(m, dtype=torch.int32)
        for j, p in enumerate(pieces):
            assert (p.slot, p.use) == (j % slots, j // slots)
            lo, hi = bounds[p.owner]
            assert lo <= p.lo <= p.hi <= hi and (chunk_rows is None or p.hi - p.lo <= chunk_rows)
            covered[p.lo:p.hi] += 1
            assert p.last == (j + 1 == len(pieces) or pieces[j + 1].owner != p.owner)
        lo, hi = bounds[rank]
        assert covered[lo:hi].eq(0).all() and (covered.sum() == m - (hi - lo))
        assert covered.le(1).all()


def _rs_calls(world_size, shard, n, k, kn, calls, dtype=torch.float16):
    """gemm_rs's schedule on fake ranks, ``calls`` calls in a row: begin, push_partials (ring
    + workers), the owner's READY wait and fp32 reduce, DONE.  Returns per call the max error
    against the float64 reference, and checks the ring's words and the generations."""
    m = world_size * shard
    ws = fake_ranks(world_size, world_size * shard * n * 2, dtype)
    bounds = [(r * shard, (r + 1) * shard) for r in range(world_size)]
    errors = []
    for call in range(1, calls + 1):
        g = torch.Generator().manual_seed(call)
        a = [torch.randn(m, k, generator=g).to(dtype) for _ in range(world_size)]
        b = [torch.randn(n, k, generator=g).to(dtype).t() for _ in range(world_size)]
        sources = {}
        for r in range(world_size):
            ws[r].data(r, (world_size * shard * n,)).fill_(float("nan"))   # poisoned inboxes
        for r in range(world_size):
            peers = [(r + i) % world_size for i in range(1, world_size)]
            ws[r].begin(ws[r].incoming("DONE", peers))
            stats = {}
            sources[r] = S.push_partials(a[r], b[r], ws[r], bounds, shard, kn, stats)
            ring, _ = S._ring(ws[r], bounds, shard, n, kn)
            assert ring.words.eq(0).all(), "ring words not reset after the workers"
            assert len(stats["chunks"]) == len(ring.pieces) > kn.slots or kn.chunk_rows is None
            assert ws[r].error[0].item() == 0
        worst = 0.0
        for r in range(world_size):
            peers = [(r + i) % world_size for i in range(1, world_size)]
            assert ws[r].gen.item() == call
            for p in peers:   # the generation of this call, raised by p's workers after its last piece
                assert ws[r].flags[r][symm.flag_index("READY", p, world_size)].item() == call
            out = torch.full((shard, n), float("nan"), dtype=dtype)
            ws[r].wait(ws[r].incoming("READY", peers), symm.WAIT_READY)
            ws[r].reduce(("rs", shard, n), sources[r], out)
            ws[r].signal(ws[r].outgoing("DONE", peers))
            lo, hi = bounds[r]
            want = sum(a[s][lo:hi].double() @ b[s].double() for s in range(world_size))
            assert torch.isfinite(out).all()
            worst = max(worst, ((out.double() - want).abs().max() / want.abs().max()).item())
        errors.append(worst)
    return errors


@pytest.mark.parametrize("world_size, shard, chunk_rows, slots, calls", [(3, 5, 2, 1, 3), (2, 7, 3, 2, 2),
                                                                        (3, 4, None, 1, 2)])
def test_ring_wraps_around_across_calls_and_every_owner_gets_the_reduce_scatter(interp, world_size, shard,
                                                                               chunk_rows, slots, calls):
    """More pieces than slots (5 rows in pieces of 2 through 1 slot: 6 pieces per call), calls
    in a row: each piece waits for its slot's credit, the owners' READY flags carry the
    call's generation, the ring's words return to 0 after every call, and every owner's fp32
    reduce is the reduce-scatter of the W products."""
    kn = S.SmWorkersKnobs(comm_sms=2, slots=slots, block_bytes=256, chunk_rows=chunk_rows)
    errors = _rs_calls(world_size, shard, 24, 20, kn, calls=calls)
    assert max(errors) < 5e-3, errors


@pytest.mark.parametrize("comm_sms, chunk_rows, slots", [(5, 7, 2), (1, 7, 1), (3, 2, 2)])
def test_ring_pieces_dealt_to_rotating_workers_wrap_and_reduce_scatter(interp, comm_sms, chunk_rows, slots):
    """The ring with the dealing rotating over the pieces (one launch per piece here, dealt as
    in one launch over the ring): pieces of 7 rows x 24 = 168 elements (1 1/3 blocks) or 2 rows
    (48: under a block), the owner's last piece shorter, 6 pieces through fewer slots, G above
    and below a piece's blocks; each owner's READY joins its pieces across launches."""
    kn = S.SmWorkersKnobs(comm_sms=comm_sms, slots=slots, block_bytes=256, chunk_rows=chunk_rows)
    errors = _rs_calls(3, 15 if chunk_rows == 7 else 5, 24, 20, kn, calls=2)
    assert max(errors) < 5e-3, errors

def test_a_producer_without_a_credit_times_out_with_a_clear_error(interp):
    """One slot, two pieces: the second piece's producer waits for the slot's credit, which
    no worker returns (the first piece's worker launch never ran): the wait ends within the
    bound and the host raises a TimeoutError naming the rank, the slot, the chunk and the owner."""
    world_size, shard, n, k = 2, 6, 8, 8
    kn = S.SmWorkersKnobs(comm_sms=2, slots=1, block_bytes=256, chunk_rows=3)
    ws = fake_ranks(world_size, world_size * shard * n * 2, torch.float16)[0]
    ws.begin(ws.incoming("DONE", [1]))
    bounds = [(r * shard, (r + 1) * shard) for r in range(world_size)]
    ring, _ = S._ring(ws, bounds, shard, n, kn)
    a, b = torch.randn(world_size * shard, k).half(), torch.randn(k, n).half()
    ring.produce(ws, 0, a, b)
    assert ring.ready.tolist() == [1] and ws.error[0].item() == 0
    ring.produce(ws, 1, a, b)                  # slot 0's use 1: needs free[0] >= 1
    # what, peer (the chunk's owner), use awaited, seen, rank, chunk, slot (ERR_TILE), program
    assert ws.error.tolist()[:9] == [1, S.WAIT_SLOT_FREE, 1, 1, 0, 0, 1, 0, -1]
    assert ws.host.record() == ws.error.tolist()[:9]
    assert ring.stalls[0].item() == 1
    with pytest.raises(TimeoutError, match=r"rank 0's producer waited .* FREE slot 0 .*chunk 1, for owner rank 1"):
        ws.check("gemm_rs")


def test_a_producer_stall_that_a_late_credit_ends_is_counted_once_and_a_free_slot_is_not(interp):
    """The credit wait's stall count on the path the bed's queue_wrap case sees (tests/gpu/bed.py):
    the slot is not FREE when the producer looks, a worker returns the credit while it spins (a
    thread here, as the side stream's worker CTA on the GPU), the wait ends without an error
    and counts one stall; a wait that finds its slot FREE counts none; the count accumulates
    over a call's waits."""
    import threading
    import time

    ws = fake_ranks(1, 4096, torch.float16)[0]
    K = _kernels()
    free, stalls = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)

    def acquire(slot, use):
        K.slot_acquire_kernel[(1,)](free, slot, use, ws.error, stalls, 100_000, 0, 1, 3, S.WAIT_SLOT_FREE,
                                    USE_ASM=False, num_warps=1)

    free[1] = 1
    acquire(1, 1)                                  # FREE already: no stall
    assert stalls.tolist() == [0, 0]
    worker = threading.Timer(0.2, lambda: free.__setitem__(0, 1))   # the credit, 200 ms late
    worker.start()
    t0 = time.monotonic()
    acquire(0, 1)
    worker.join()
    assert time.monotonic() - t0 >= 0.15           # it did wait for the credit
    assert stalls[0].item() == 1 and ws.error[abi.ERR_STATUS].item() == 0
    free[1] = 0
    threading.Timer(0.1, lambda: free.__setitem__(1, 2)).start()
    acquire(1, 2)
    assert stalls[0].item() == 2 and ws.error[abi.ERR_STATUS].item() == 0


def test_ag_gemm_workers_fill_the_gathered_input_and_the_gemm_waits_per_chunk(interp):
    """ag_gemm's two phases on 3 fake ranks, two calls in a row, shards of 6 rows in chunks of 3
    (each with an arrival word): the gathered input is bitwise the shards, c is the product, the
    arrival words are 0 again after the call, and the DONE credits let the next call begin."""
    world_size, m_shard, n, k = 3, 6, 7, 9
    kn = S.SmWorkersKnobs(comm_sms=2, block_bytes=256, chunk_rows=3)
    ws = fake_ranks(world_size, m_shard * k * 2, torch.float16, op="ag_gemm")
    for call in range(2):
        g = torch.Generator().manual_seed(call)
        a = torch.randn(world_size * m_shard, k, generator=g).half()
        b = torch.randn(n, k, generator=g).half().t()
        for r in range(world_size):
            S.ag_publish(a[r * m_shard:(r + 1) * m_shard], ws[r], kn)
        for r in range(world_size):
            a_full = torch.full((world_size * m_shard, k), float("nan")).half()
            c = torch.full((world_size * m_shard, n), float("nan")).half()
            stats = {}
            S.ag_pull_and_gemm(a[r * m_shard:(r + 1) * m_shard], b, ws[r], kn, a_full, c, stats)
            assert ws[r].error[0].item() == 0
            assert torch.equal(a_full, a)
            ref = a.double() @ b.double()
            assert (c.double() - ref).abs().max() <= 5e-3 * ref.abs().max()
            assert S._words(ws[r], "arrived", world_size * 2).eq(0).all()
            # the GEMM's waits share the workspace's error word and outlast the flag waits (fused's slack)
            wait = S._ag_plan(ws[r], m_shard, k, 3).wait
            assert wait.error is ws[r].error
            assert wait.max_spins == int((symm.timeout_s() + S.GEMM_WAIT_SLACK_S) * 1000)
            assert [ch["chunk"] for ch in stats["chunks"]] == [((r + i) % world_size) * 2 + q
                                                               for i in (1, 2) for q in (0, 1)]
    with pytest.raises(ValueError, match="chunk_rows=4 does not divide the shard's 6 rows"):
        S._ag_chunk_rows(6, S.SmWorkersKnobs(comm_sms=1, chunk_rows=4))


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs", "gemm_ar"])
def test_a_call_whose_peer_is_dead_returns_nan_then_the_next_call_raises(interp, monkeypatch, op):
    """sm_workers' own code on rank 0 of 2 under the interpreter (streams faked: one CPU
    "stream"), rank 1 dead: the call returns without raising and its outputs are NaN; a call
    queued after it (issued before the host looked) returns at once, NaN too; then the next
    call on the group and ``tpfuse.synchronize()`` raise TimeoutError naming rank 1 (from the
    host record: the workers' READY wait, or the owner's reduce); after release_workspaces
    calls work.  gemm_ar takes
    the two-shot path (the workers' pulls)."""
    import time
    import types

    import tpfuse
    from tpfuse.strategies import copy_engine

    fake_cuda_streams(monkeypatch)
    monkeypatch.setattr(copy_engine, "ar_mode", lambda *a: "two_shot")
    made, checking = dead_peer_workspaces(monkeypatch)
    ctx = types.SimpleNamespace(rank=0, world_size=2, group_name="deadpeer_smw", group=None)
    kn = S.SmWorkersKnobs(comm_sms=2, slots=1, block_bytes=256, chunk_rows=4 if op != "ag_gemm" else None)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(32 if op != "ag_gemm" else 16, 16, generator=g).half()
    b = torch.randn(16, 24, generator=g).half()
    fn = getattr(S, op)
    symm.release_workspaces()
    try:
        t0 = time.perf_counter()
        first = fn(a, b, ctx, knobs=kn)
        queued = fn(a, b, ctx, knobs=kn)
        for out in (first, queued):
            for x in (out if isinstance(out, tuple) else (out,)):
                assert x.isnan().all(), f"sm_workers {op}: an output of a call of a broken workspace is not NaN"
        assert time.perf_counter() - t0 < 30
        record = made[next(iter(made))].host.record()
        assert record[abi.ERR_WHAT] == abi.WAIT_READY and record[abi.ERR_PEER] == 1 and record[abi.ERR_RANK] == 0
        checking[0] = True
        with pytest.raises(TimeoutError, match=r"rank 0 waited more than .* for rank 1"):
            fn(a, b, ctx, knobs=kn)
        with pytest.raises(TimeoutError, match=r"for rank 1 .*release_workspaces"):   # and the explicit check
            tpfuse.synchronize()
        symm.release_workspaces()
        made.clear()
        assert not symm.get_workspace(ctx, op, a.dtype, a.device, 16).failed()
    finally:
        symm.release_workspaces()


def test_the_ring_waits_are_explained_from_the_host_record():
    """The watchdog's and the next call's words for this strategy's own wait codes (no
    collision with the GEMM hook's WAIT_GEMM_CHUNK)."""
    codes = [abi.WAIT_CREDIT, abi.WAIT_READY, abi.WAIT_CREDIT2, abi.WAIT_READY2, abi.WAIT_GEMM_CHUNK,
             abi.WAIT_SLOT_FREE, abi.WAIT_SLOT_READY]
    assert len(set(codes)) == len(codes) and (S.WAIT_SLOT_FREE, S.WAIT_SLOT_READY) == (6, 7)
    words = [1, abi.WAIT_SLOT_READY, 3, 2, 1, 0, 5, -1, 4]
    text = watchdog.describe(words, op="gemm_rs", rank=0, timeout_s=2.0)
    assert "rank 0's worker CTAs waited more than 2 s" in text and "ring chunk 5 (for owner rank 3)" in text
    words[abi.ERR_WHAT], words[abi.ERR_TILE] = abi.WAIT_SLOT_FREE, 1
    text = watchdog.describe(words, op="gemm_ar", rank=0, timeout_s=2.0)
    assert "rank 0's producer waited" in text and "FREE slot 1" in text and "chunk 5, for owner rank 3" in text


# --------------------------------------------------------------------------------------------
# knobs and stats (plain Python)
# --------------------------------------------------------------------------------------------
def test_knobs_are_checked_and_defaults_are_a_pure_function_of_the_gpu_and_w():
    for bad in (dict(comm_sms=0), dict(comm_sms=True), dict(comm_sms=2, slots=0), dict(comm_sms=2, block_bytes=1000),
                dict(comm_sms=2, block_bytes=128), dict(comm_sms=2, chunk_rows=0)):
        with pytest.raises(ValueError, match="SmWorkersKnobs"):
            S.SmWorkersKnobs(**bad)
    assert S.default_knobs(4, 132) == S.SmWorkersKnobs(comm_sms=16, slots=2, block_bytes=16384)
    assert S.default_knobs(4, 132, shared_gpu=True).comm_sms == 132 // 5 // 4
    assert S.default_knobs(2, 8).comm_sms == 2
    # the AG GEMM leaves the workers' SMs free, within fused's budget
    assert S.gemm_programs(132, 4, 16) == 131 - 16
    assert S.gemm_programs(132, 4, 6, shared_gpu=True) == 132 // 5 - 6
    assert S.gemm_programs(8, 2, 16) == 1
    # the one-GPU bed (W processes on one 132-SM H200): workers + AG GEMM per process stay within
    # fused's per-process budget (W = 4: 24-32 programs each worked, the full grid timed out), so
    # the W processes' spinning grids leave SMs // (W + 1) SMs free for what they wait on
    for w, per_process in ((2, 44), (4, 26)):
        for comm in (S.default_knobs(w, 132, shared_gpu=True).comm_sms, 1):
            spinning = w * (comm + S.gemm_programs(132, w, comm, shared_gpu=True))
            assert spinning == w * per_process and 132 - spinning >= 132 // (w + 1), (w, comm, spinning)
    with pytest.raises(TypeError, match="knobs: expected"):
        S._knobs({"comm_sms": 2}, 2, torch.device("cpu"))


def test_summarize_derives_in_flight_bytes_queue_depth_and_the_tail_from_the_stamps():
    tasks = [S.Task(src=0, dst=0, numel=100, chunk=j, peer=1) for j in range(3)]
    #              wait start, copy start, copy end, waited CTAs   (ns)
    stats = torch.tensor([[0, 10, 50, 0], [5, 20, 70, 2], [60, 80, 120, 1]])
    kn = S.SmWorkersKnobs(comm_sms=2, block_bytes=256, slots=2)
    got = S.summarize(tasks, stats, kn, elem=2, gemm_end_ns=torch.tensor(65), ready_ns=torch.tensor([5, 8, 15]),
                      stalls=torch.tensor([3, 400]))
    assert [c["latency_ns"] for c in got["chunks"]] == [40, 50, 40]
    assert [c["wait_ns"] for c in got["chunks"]] == [10, 15, 20]
    assert got["max_bytes_in_flight"] == 400 and got["bytes_in_flight_bound"] == 512   # two tasks at once
    assert got["bytes_outstanding_at_gemm_end"] == 400                                  # tasks 1 and 2
    assert got["max_ready_queue_depth"] == 2                                            # 0 and 1 ready at 8
    assert (got["producer_stalls"], got["producer_stall_ns"]) == (3, 400)
    capped = S.summarize(tasks, stats, S.SmWorkersKnobs(comm_sms=1, block_bytes=256), elem=2)
    assert capped["max_bytes_in_flight"] == 256


# --------------------------------------------------------------------------------------------
# sm_90 compile (no GPU: Triton ships ptxas)
# --------------------------------------------------------------------------------------------
def skip_unless_sm90_ptx_of_triton_36() -> None:
    """Skip a test that compiles for sm_90 and reads the PTX: not under the interpreter, only
    with Triton's bundled ptxas, and only on Triton 3.6.x (whose PTX the patterns describe)."""
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiling needs Triton's compiler, not the interpreter")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton without its bundled ptxas")
    if not triton.__version__.startswith("3.6."):   # the PTX patterns are what Triton 3.6 emits
        pytest.skip(f"the PTX checks are pinned to Triton 3.6.x; this is {triton.__version__}")


def _compile(fn, args, constexprs, num_warps):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tpfuse.gemm.offline import _signature

    pointers = {name for name, v in args.items() if isinstance(v, torch.Tensor)}
    sig, attrs, cons = _signature(fn.arg_names, args, constexprs, lambda name, v: name in pointers)
    return triton.compile(ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=cons),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def test_kernels_compile_for_sm90_with_vector_copies_and_system_scope_ordering():
    """The worker kernel as launched on the H200 (bf16, 16 KiB blocks, 8 warps): 16-byte vector
    loads and stores when aligned, the flag waited with ld.acquire.sys, the count an acq_rel
    GPU-scope add, the publishes release.sys exchanges; the ring kernels compile too."""
    skip_unless_sm90_ptx_of_triton_36()
    _drop_module()
    K = _kernels()
    i32, i64 = torch.empty(4, dtype=torch.int32), torch.empty(4, dtype=torch.int64)
    args = dict(tasks_ptr=i64, task_lo=0, task_hi=1, dst_base=0, gen_ptr=i32, counters_ptr=i32, err_ptr=i32,
                stats_ptr=i64, scratch_ptr=i32, timeout=1, rank=0)
    for vec, stats in ((8, False), (1, True)):
        ptx = _compile(K.worker_kernel, args, dict(ELEM=16, BLOCK=8192, VEC=vec, USE_ASM=True, STATS=stats),
                       8).asm["ptx"]
        v4 = len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)), len(re.findall(r"st\.global(\.\w+)*\.v4", ptx))
        assert (v4[0] > 0 and v4[1] > 0) == (vec == 8), v4
        assert re.search(r"ld\.global\.acquire\.sys", ptx)
        assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)
        # the task's two publishes, and signals.record_error's release of the host mirror's status
        assert len(re.findall(r"atom\.global\.sys\.release\.exch", ptx)) == 3
        assert re.search(r"atom\.global\.acq_rel\.sys\.cas", ptx)   # record_error's CAS on the error word
    ptx = _compile(K.slot_acquire_kernel, dict(free_ptr=i32, slot=0, use=1, err_ptr=i32, stall_ptr=i64,
                                               timeout=1, rank=0, peer=0, chunk=0, what=S.WAIT_SLOT_FREE),
                   dict(USE_ASM=True), 1).asm["ptx"]
    assert re.search(r"ld\.global\.acquire\.sys", ptx) and "globaltimer" in ptx
    ptx = _compile(K.slot_ready_kernel, dict(ready_ptr=i32, slot=0, use=1, stamp_ptr=i64, chunk=0, err_ptr=i32),
                   dict(USE_ASM=True), 1).asm["ptx"]
    assert re.search(r"atom\.global\.sys\.release\.exch", ptx)
    _compile(K.stamp_kernel, dict(stamp_ptr=i64, index=0), dict(USE_ASM=True), 1)
    _drop_module()


# --------------------------------------------------------------------------------------------
# a gloo group: refused on every rank, with the reason
# --------------------------------------------------------------------------------------------
def _refused(rank, world_size):
    import tpfuse
    from conftest import caught_then_probe

    a = torch.randn(4, 8)
    b = torch.randn(8, 6)
    return [caught_then_probe(rank, call) for call in (
        lambda: tpfuse.ag_gemm(a, b, strategy="sm_workers"),
        lambda: tpfuse.gemm_rs(a.repeat(world_size, 1), b, strategy="sm_workers"),
        lambda: tpfuse.gemm_ar(a, b, strategy="sm_workers"))]


def test_sm_workers_on_a_gloo_group_raises_value_error_on_every_rank(rank_pool):
    results = rank_pool(2).run(_refused, timeout=120)
    for per_rank in results:
        for caught, probe in per_rank:
            assert probe == 1.0                                     # no rank left in a collective
            assert caught is not None and caught[0] == "ValueError", caught
            assert "sm_workers needs CUDA symmetric memory" in caught[1] and "gloo" in caught[1], caught
