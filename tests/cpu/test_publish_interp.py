"""ag_gemm's publish step in one launch (issue 34: tpfuse/kernels/flags.py ``publish_kernel``,
``symm.Workspace.publish``, ``_symm_steps.publish_shard``) under TRITON_INTERPRET=1 on fake ranks
(CPU tensors stand in for the ranks' symmetric allocations): the credit wait, the byte copies into
this rank's slot and a second destination (any row stride, any dtype, fp8 scale rows), the local
words, READY on every peer only after every program's copies, the generation advance and the
counter reset; a missing credit (TimeoutError naming the peer, NaN outputs through the
strategies' own code); a broken workspace (nothing copied or published).  The sm_90 compile of
the kernel is checked in tests/cpu/test_sm_workers_interp.py's way (Triton ships ptxas)."""
from __future__ import annotations

import os
import re
import time
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

from tpfuse import symm  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402
from tpfuse.strategies import _symm_steps as steps  # noqa: E402

from _symm_interp import dead_peer_workspaces, fake_cuda_streams, fake_ranks, interpreted  # noqa: E402


@pytest.fixture
def interp(monkeypatch):
    # a few bytes per program: the small shards here spread over several programs, so that the
    # last-program publish and the counter reset are exercised
    monkeypatch.setattr(symm, "PUBLISH_BYTES_PER_PROGRAM", 48)
    with interpreted():
        yield


def _ready(ws, owner, src):
    return ws[owner].flags[owner][symm.flag_index("READY", src, len(ws))].item()


def _give_credit(ws, owner, reader, value):
    ws[owner].flags[owner][symm.flag_index("DONE", reader, len(ws))] = value


def test_publish_copies_into_the_slot_and_a_second_destination_then_signals_every_peer(interp):
    """Rank 1 of 3, two calls: a strided float16 shard (row stride 16, 10 columns: the byte path
    with row arithmetic), then a contiguous one (the flat path): slot and second destination
    bit-equal to the shard, the local words set, READY = the call's generation on both peers,
    the generation advanced once per call, the counter back at 0."""
    ws = fake_ranks(3, 4096, torch.float16, op="ag_gemm")
    me, peers = ws[1], steps.peers(1, 3)
    credits, ready = me.incoming("DONE", peers), me.outgoing("READY", peers)
    words = torch.zeros(4, dtype=torch.int32)
    table = me.pointer_table("words", [words[1], words[3]])
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 16, generator=g).half()
    for call, shard in enumerate((wide[:, 3:13], torch.randn(6, 10, generator=g).half()), start=1):
        also = torch.full((6, 10), -7.0, dtype=torch.float16)
        words.zero_()
        steps.publish_shard(me, shard, credits, ready, also=also, words=table)
        assert torch.equal(me.data(1, (6, 10)), shard) and torch.equal(also, shard)
        assert words.tolist() == [0, 1, 0, 1]
        assert [_ready(ws, p, 1) for p in peers] == [call, call]
        assert me.gen.item() == call and me.calls == call and me.error[0].item() == 0
        assert me.publish_sync[0].item() == 0     # reset by the last program for the next launch
        for p in peers:
            _give_credit(ws, 1, p, call)          # the peers read it: credits for the next call
    assert me._publish and len(next(iter(me._publish.values()))[0]) == 1   # 1-D grid, several programs
    assert next(iter(me._publish.values()))[0][0] > 1


@pytest.mark.parametrize("shared", [False, True])
def test_publish_grid_is_divided_among_ranks_that_share_one_gpu(interp, monkeypatch, shared):
    """A shard big enough for PUBLISH_MAX_PROGRAMS programs: all of them on a GPU of its own;
    PUBLISH_MAX_PROGRAMS // W each where the W ranks share one GPU (the bed: four grids of 64
    spinning on credits starved the copies those credits wait for), and the copy still whole."""
    monkeypatch.setattr(symm, "PUBLISH_MAX_PROGRAMS", 8)
    if shared:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    else:
        monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", raising=False)
    ws = fake_ranks(4, 8192, torch.float16, op="ag_gemm")
    me, peers = ws[0], steps.peers(0, 4)
    shard = torch.randn(16, 12).half()                       # 384 bytes: 8 programs of 48 bytes
    steps.publish_shard(me, shard, me.incoming("DONE", peers), me.outgoing("READY", peers))
    assert torch.equal(me.data(0, (16, 12)), shard) and [_ready(ws, p, 0) for p in peers] == [1, 1, 1]
    assert next(iter(me._publish.values()))[0] == ((2,) if shared else (8,))


def test_publish_moves_fp8_bytes_and_strided_scale_rows(interp):
    """An fp8 shard (bytes, whatever the values) and its row-wise scale rows from a strided view
    into the slot layout of tpfuse/strategies/_symm_steps.py and into the second destinations."""
    ws = fake_ranks(2, 4096, torch.float8_e4m3fn, op="ag_gemm")
    me = ws[0]
    g = torch.Generator().manual_seed(1)
    shard = torch.randint(0, 256, (5, 32), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    scales = torch.rand(5, 3, generator=g)[:, 1:2]     # [5, 1], row stride 3
    also = torch.zeros(5, 32, dtype=torch.float8_e4m3fn)
    scale_also = torch.zeros(5, 1)
    steps.publish_shard(me, shard, me.incoming("DONE", [1]), me.outgoing("READY", [1]), scales,
                        also=also, scale_also=scale_also)
    assert torch.equal(me.data(0, (5, 32)).view(torch.uint8), shard.view(torch.uint8))
    assert torch.equal(also.view(torch.uint8), shard.view(torch.uint8))
    assert torch.equal(steps.ag_scale_slot(me, 0, 5, 32), scales) and torch.equal(scale_also, scales)
    assert _ready(ws, 1, 0) == 1


def test_a_missing_credit_times_out_naming_the_peer_and_publishes_nothing(interp):
    """Rank 0 of 3 at its 3rd call: rank 2 returned its credit of call 2, rank 1 did not.  The
    launch records (credit, peer 1, generation 2, last seen 1, rank 0) in the word and its host
    mirror, copies nothing, raises READY nowhere; the host then raises a TimeoutError naming
    rank 1 (no device read); the generation still advanced (as begin's wait advances it)."""
    ws = fake_ranks(3, 4096, torch.float16, op="ag_gemm")
    me = ws[0]
    me.gen.fill_(2)
    _give_credit(ws, 0, 1, 1)
    _give_credit(ws, 0, 2, 2)
    shard = torch.ones(4, 8, dtype=torch.float16)
    also = torch.zeros(4, 8, dtype=torch.float16)
    steps.publish_shard(me, shard, me.incoming("DONE", [1, 2]), me.outgoing("READY", [1, 2]), also=also)
    err = me.error.tolist()
    assert err[abi.ERR_STATUS] == 1 and err[abi.ERR_WHAT] == abi.WAIT_CREDIT and err[abi.ERR_PEER] == 1
    assert (err[abi.ERR_GENERATION], err[abi.ERR_SEEN], err[abi.ERR_RANK], err[abi.ERR_CHUNK]) == (2, 1, 0, -1)
    assert me.host.failed() and me.host.record()[abi.ERR_PEER] == 1
    assert not me.data(0, (4, 8)).any() and not also.any()          # nothing copied
    assert _ready(ws, 1, 0) == 0 and _ready(ws, 2, 0) == 0           # nothing published
    assert me.gen.item() == 3 and me.publish_sync[0].item() == 0
    with pytest.raises(TimeoutError, match=r"rank 0 waited .* for rank 1 to finish reading this rank's buffer"):
        me.check("ag_gemm")


def test_publish_waits_for_every_peers_ready_in_its_launch(interp):
    """copy_engine and fused ag_gemm (``wait_ready``): after raising READY, the launch waits for
    every peer's READY to this rank.  Rank 0 of 3 at its first call: both peers' READY there
    -> healthy, nothing recorded; at its second call rank 2's READY stays at 1 -> the launch
    (its copy and READY out done) records (READY, peer 2, generation 2, seen 1, rank 0), the
    host raises a TimeoutError naming rank 2 without a device read, and the counter is reset."""
    ws = fake_ranks(3, 4096, torch.float16, op="ag_gemm")
    me, peers = ws[0], [1, 2]
    credits, ready, ready_in = me.incoming("DONE", peers), me.outgoing("READY", peers), me.incoming("READY", peers)
    shard = torch.ones(4, 8, dtype=torch.float16)
    for p in peers:
        ws[0].flags[0][symm.flag_index("READY", p, 3)] = 1
    steps.publish_shard(me, shard, credits, ready, wait_ready=ready_in)
    assert me.error[abi.ERR_STATUS].item() == 0 and not me.host.failed()
    assert [_ready(ws, p, 0) for p in peers] == [1, 1] and me.gen.item() == 1
    for p in peers:
        _give_credit(ws, 0, p, 1)
    ws[0].flags[0][symm.flag_index("READY", 1, 3)] = 2     # rank 1 published call 2; rank 2 did not
    steps.publish_shard(me, 2 * shard, credits, ready, wait_ready=ready_in)
    err = me.error.tolist()
    assert err[abi.ERR_STATUS] == 1 and err[abi.ERR_WHAT] == abi.WAIT_READY and err[abi.ERR_PEER] == 2
    assert (err[abi.ERR_GENERATION], err[abi.ERR_SEEN], err[abi.ERR_RANK]) == (2, 1, 0)
    assert torch.equal(me.data(0, (4, 8)), 2 * shard) and [_ready(ws, p, 0) for p in peers] == [2, 2]
    assert me.publish_sync[0].item() == 0
    with pytest.raises(TimeoutError, match=r"rank 0 waited .* for rank 2"):
        me.check("ag_gemm")


def _ag_on_rank_0_of_2(monkeypatch, strategy: str, group: str, seed: int):
    """The strategy's own ag_gemm on rank 0 of a 2-rank group whose rank 1 never runs (streams
    faked, one piece per rank): ``(fn, a, b, ctx, made, checking)`` (tests/cpu/_symm_interp.py
    ``dead_peer_workspaces``), the workspaces released first."""
    from tpfuse.strategies import copy_engine, fused

    fake_cuda_streams(monkeypatch)
    monkeypatch.setattr(fused, "sm_budget", lambda device, w, knobs=None: 2)
    monkeypatch.setattr(fused, "chunks_per_rank", lambda *a: 1)
    monkeypatch.setattr(fused, "_set_word", lambda words, i, stream: words.words.__setitem__(i, 1))   # the stream memory op
    made, checking = dead_peer_workspaces(monkeypatch)
    ctx = types.SimpleNamespace(rank=0, world_size=2, group_name=group, group=None)
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(16, 16, generator=g).half(), torch.randn(16, 24, generator=g).half()
    symm.release_workspaces()
    return {"copy_engine": copy_engine, "fused": fused}[strategy].ag_gemm, a, b, ctx, made, checking


@pytest.mark.parametrize("strategy", ["copy_engine", "fused"])
def test_a_peer_that_never_publishes_makes_nan_outputs_then_the_next_call_raises(interp, monkeypatch, strategy):
    """The strategy's own ag_gemm on rank 0 of 2 (streams faked): rank 1 returns every credit
    but never raises READY.  The publish launch times out on it: the call's outputs are NaN
    (the pulls ran after the launch and copied whatever the slot held), no DONE goes back to
    rank 1; the next call raises a TimeoutError naming rank 1."""
    fn, a, b, ctx, made, checking = _ag_on_rank_0_of_2(monkeypatch, strategy, "noready", 3)
    try:
        ws = symm.get_workspace(ctx, "ag_gemm", a.dtype, a.device, 16)
        ws.flags[0][symm.flag_index("DONE", 1, 2)] = 100     # every credit back, READY never
        out = fn(a, b, ctx)
        assert all(x.isnan().all() for x in out), f"{strategy}: outputs of a call whose READY wait timed out"
        assert ws.error[abi.ERR_WHAT].item() == abi.WAIT_READY and ws.error[abi.ERR_PEER].item() == 1
        assert ws.flags[1][symm.flag_index("DONE", 0, 2)].item() == 0    # no credit for a slot never read
        assert made["ag_gemm"] is ws
        checking[0] = True
        with pytest.raises(TimeoutError, match=r"rank 0 waited more than .* for rank 1"):
            fn(a, b, ctx)
    finally:
        symm.release_workspaces()


def test_a_broken_workspace_copies_and_publishes_nothing_and_returns_at_once(interp):
    """The error word already set (an earlier timeout): the launch does not spin, records
    nothing more, copies nothing, raises READY nowhere; it still advances the generation and sets
    the local words (the call's outputs are NaN: the strategies' NaN fill)."""
    ws = fake_ranks(2, 4096, torch.float16, op="ag_gemm")
    me = ws[0]
    me.error[abi.ERR_STATUS] = 1
    me.error[abi.ERR_PEER] = 5
    before = me.error.tolist()
    words = torch.zeros(2, dtype=torch.int32)
    shard = torch.ones(4, 8, dtype=torch.float16)
    also = torch.zeros(4, 8, dtype=torch.float16)
    t0 = time.perf_counter()
    # no credit at all (the generation asks for call 4's): a healthy launch would time out
    me.gen.fill_(4)
    steps.publish_shard(me, shard, me.incoming("DONE", [1]), me.outgoing("READY", [1]), also=also,
                        words=me.pointer_table("w", [words[0]]))
    assert time.perf_counter() - t0 < 0.5 and me.error.tolist() == before
    assert not me.data(0, (4, 8)).any() and not also.any() and _ready(ws, 1, 0) == 0
    assert me.gen.item() == 5 and words.tolist() == [1, 0] and me.publish_sync[0].item() == 0


@pytest.mark.parametrize("broken", [False, True])
def test_the_nan_fill_resets_the_words_in_its_launch_broken_or_not(interp, broken):
    """fused ag_gemm's end: the NaN fill's first launch also sets its ``zero`` words to 0 (the
    arrival words of the next call), whatever the error word; the outputs are NaN only when broken."""
    ws = fake_ranks(2, 4096, torch.float16, op="ag_gemm")[0]
    if broken:
        ws.error[abi.ERR_STATUS] = 1
    words = torch.ones(1500, dtype=torch.int32)    # more than one block of the kernel
    c, a_full, third = torch.zeros(3, 4, dtype=torch.float16), torch.zeros(5, dtype=torch.float16), torch.zeros(2)
    steps.finish(ws, c, a_full, zero=words)
    assert not words.any()
    assert bool(c.isnan().all()) == broken and bool(a_full.isnan().all()) == broken
    words.fill_(1)
    ws.poison_on_error(c, a_full, third, zero=words)   # two launches: the words in the first
    assert not words.any() and bool(third.isnan().all()) == broken


@pytest.mark.parametrize("strategy", ["copy_engine", "fused"])
def test_a_peer_that_never_returns_its_credit_makes_nan_outputs_then_the_next_call_raises(interp, monkeypatch,
                                                                                           strategy):
    """The strategy's own ag_gemm on rank 0 of 2 (streams faked): rank 1 published its data
    (its READY word is set ahead) but never returns a credit.  The first call passes; the second
    one's publish launch times out on the credit: its outputs are NaN, nothing is published; the
    next call raises a TimeoutError naming rank 1 and the credit."""
    fn, a, b, ctx, made, checking = _ag_on_rank_0_of_2(monkeypatch, strategy, "nocredit", 2)
    try:
        ws = symm.get_workspace(ctx, "ag_gemm", a.dtype, a.device, 16)
        ws.flags[0][symm.flag_index("READY", 1, 2)] = 100     # rank 1's data "landed" for every call
        first = fn(a, b, ctx)
        assert all(torch.isfinite(x).all() for x in first) and ws.error[0].item() == 0
        second = fn(a, b, ctx)
        assert all(x.isnan().all() for x in second), f"{strategy}: outputs of a call whose credit timed out"
        assert ws.error[abi.ERR_WHAT].item() == abi.WAIT_CREDIT and ws.error[abi.ERR_PEER].item() == 1
        assert made["ag_gemm"] is ws
        checking[0] = True
        with pytest.raises(TimeoutError, match=r"rank 0 waited more than .* for rank 1 to finish reading"):
            fn(a, b, ctx)
    finally:
        symm.release_workspaces()


def test_publish_kernel_compiles_for_sm90_with_vector_copies_and_system_scope_ordering():
    """The kernel as launched on the H200 (8 warps, blocks of 4096 4-byte elements): 16-byte vector loads and
    stores on the aligned flat path, the credits waited with ld.acquire.sys, the count an acq_rel
    GPU-scope add, READY a release.sys exchange; the strided path and the scale job compile too."""
    from test_sm_workers_interp import _compile, skip_unless_sm90_ptx_of_triton_36

    skip_unless_sm90_ptx_of_triton_36()

    from tpfuse.gemm.offline import sass_of
    from tpfuse.kernels import flags

    i32, i64, f16 = (torch.empty(4, dtype=d) for d in (torch.int32, torch.int64, torch.float16))
    args = dict(gen_ptr=i32, sync_ptr=i32, err_ptr=i32, credits_ptr=i64, peers_ptr=i64, num_credits=1,
                ready_ptr=i64, num_ready=1, local_ptr=i64, num_local=0, local_value=1, timeout=1, what=1, rank=0,
                in_ptr=i64, in_peers_ptr=i64, num_in=1, what_in=2,
                a_src=f16, a_stride=32, a_dst=f16, a_dst2=f16, a_rows=4, a_row_bytes=32,
                b_src=i32, b_stride=4, b_dst=i32, b_dst2=i32, b_rows=4, b_row_bytes=4)
    for a_contig, has_b, dst2 in ((True, False, True), (False, False, True), (True, True, False)):
        kern = _compile(flags.publish_kernel, args, dict(BLOCK=4096, A_ELEM=4 if a_contig else 2, A_CONTIG=a_contig, A_ALIGNED=a_contig,
                                                          B_CONTIG=True, HAS_B=has_b, DST2=dst2, USE_ASM=True), 8)
        ptx = kern.asm["ptx"]
        v4 = len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)), len(re.findall(r"st\.global(\.\w+)*\.v4", ptx))
        assert (v4[0] > 0 and v4[1] > 0) == a_contig, v4   # the strided path: element by element
        # the credits' and the peers' READY waits: each an acquire at system scope, timed
        assert len(re.findall(r"ld\.global\.acquire\.sys", ptx)) >= 2 and "globaltimer" in ptx
        assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)
        # READY, and signals.record_error's release of the host mirror's status (after each wait)
        assert len(re.findall(r"atom\.global\.sys\.release\.exch", ptx)) == 3
        assert re.search(r"atom\.global\.acq_rel\.sys\.cas", ptx)   # record_error's CAS on the error word
        _, res = sass_of(kern.asm["cubin"])
        # no register spills (the cubin: ptxas ran); a stack frame of at most 16 bytes: with the second
        # spin loop (the peers' READY) ptxas keeps convergence-barrier state there, not registers
        assert "LOCAL:0" in res and int(re.search(r"STACK:(\d+)", res).group(1)) <= 16, res
