"""Two-shot gemm_ar's phase 2 in one launch (issue 34: tpfuse/kernels/flags.py ``gather_kernel``,
``symm.Workspace.gather``, ``_symm_steps.gather_reduced(one_launch=True)``, fused's) under
TRITON_INTERPRET=1 on fake ranks (CPU tensors stand in for the ranks' symmetric allocations): the
READY2 waits, the byte copies of every peer's reduced chunk into its rows of the output (chunks of
any size, aligned or not), DONE2 on every peer only after every program's copies, the counter
reset, two generations in a row; a peer that never raises READY2 (the record names it, the whole
output NaN, no DONE2, then TimeoutError on the host); a workspace broken before the launch (NaN,
nothing waited for or raised).  The strategies' own calls with a dead peer are
tests/cpu/test_async_errors.py's, across processes tests/cpu/test_fp8_symm_interp.py's; the sm_90
compile is checked as tests/cpu/test_publish_interp.py checks the publish kernel's."""
from __future__ import annotations

import re
import time

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

from tpfuse import symm  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402
from tpfuse.strategies import _symm_steps as steps  # noqa: E402

from _symm_interp import fake_ranks, interpreted  # noqa: E402


@pytest.fixture
def interp(monkeypatch):
    # a few bytes per program: the small chunks here spread over several programs, so that the
    # last-program DONE2 / NaN fill and the counter reset are exercised
    monkeypatch.setattr(symm, "PUBLISH_BYTES_PER_PROGRAM", 48)
    with interpreted():
        yield


@pytest.fixture
def launched(monkeypatch):
    """The gather launches' (grid, constexprs), as symm._run is given them."""
    seen = []
    run = symm._run

    def spy(kernel, grid, args, constexprs, num_warps, device):
        if kernel.__name__ == "gather_kernel":
            seen.append((grid, dict(constexprs)))
        return run(kernel, grid, args, constexprs, num_warps, device)

    monkeypatch.setattr(symm, "_run", spy)
    return seen


def _flag(ws, owner, region, other):
    return ws[owner].flags[owner][symm.flag_index(region, other, len(ws))].item()


def _raise_ready2(ws, me, peer, value):
    ws[me].flags[me][symm.flag_index("READY2", peer, len(ws))] = value


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


def _setup(ws, me, dtype, rows, n, slot_offset=0):
    """Rank ``me``'s peers (issue order), their gather slots (``rows[i]`` rows of ``n`` for the i-th
    peer, ``slot_offset`` elements into its data region), the element offsets in the output where
    they go (after 3 own rows, in peer order: any sizes), and the first row after them."""
    peers = steps.peers(me, len(ws))
    own = 3
    lo, sources, offsets = own, [], []
    for p, r in zip(peers, rows):
        sources.append(ws[me].data(p, (r, n), offset=slot_offset))
        offsets.append(lo * n)
        lo += r
    return peers, sources, offsets, lo


def _fill(sources, seed):
    """Random bytes: NaN and Inf patterns too, which a copy through floats might not keep."""
    g = torch.Generator().manual_seed(seed)
    for s in sources:
        _bytes(s).copy_(torch.randint(0, 256, (s.nbytes,), generator=g, dtype=torch.uint8))


@pytest.mark.parametrize("dtype, rows, n, slot_offset, elem, aligned", [
    (torch.float16, (4, 4), 8, 0, 4, True),        # 16-byte vectors
    (torch.float32, (3, 5), 7, 0, 4, False),       # uneven chunks (84, 140 B): not 16-byte multiples
    (torch.float16, (3, 5), 7, 1, 2, False),       # odd element counts at an odd element: 2-byte copies
    (torch.float8_e4m3fn, (4, 7), 13, 3, 1, False),  # 1-byte elements, odd sizes and addresses
])
def test_the_gather_pulls_every_chunk_bit_exact_then_raises_done2_twice(interp, launched, dtype, rows, n, slot_offset,
                                                                         elem, aligned):
    """Rank 1 of 3, two calls (generations 1 and 2, new data in the peers' slots each time): every
    peer's chunk lands in its rows of the output bit for bit, the own rows and the rows after are
    untouched, DONE2 = the generation on both peers, the error word clear, the counter back at 0;
    the copies took the widest element the sizes and addresses allow."""
    ws = fake_ranks(3, 4096, dtype, op="gemm_ar")
    me = ws[1]
    peers, sources, offsets, end = _setup(ws, 1, dtype, rows, n, slot_offset)
    for gen in (1, 2):
        _fill(sources, seed=gen)
        me.gen.fill_(gen)
        for p in peers:
            _raise_ready2(ws, 1, p, gen)
        out = torch.full((end + 2, n), -3.0).to(dtype)
        sentinel = out.clone()
        me.gather(("t", dtype), me.incoming("READY2", peers), sources, offsets, out, me.outgoing("DONE2", peers))
        for src, off in zip(sources, offsets):
            assert torch.equal(_bytes(out.view(-1)[off:off + src.numel()]), _bytes(src.reshape(-1)))
        assert torch.equal(_bytes(out[:3]), _bytes(sentinel[:3])) and torch.equal(_bytes(out[end:]), _bytes(sentinel[end:]))
        assert [_flag(ws, p, "DONE2", 1) for p in peers] == [gen, gen]
        assert me.error[abi.ERR_STATUS].item() == 0 and me.gather_sync[0].item() == 0
    (grid, constexprs), _ = launched
    assert grid[0] > 1 and (constexprs["ELEM"], constexprs["ALIGNED"]) == (elem, aligned), launched


def test_chunks_of_several_blocks_are_striped_over_the_programs(interp, monkeypatch, launched):
    """Chunks of more than one block of the kernel (4096 elements) on 3 programs: whole blocks and
    the masked tail, every program's stripe, bit-exact."""
    monkeypatch.setattr(symm, "PUBLISH_BYTES_PER_PROGRAM", 8192)
    ws = fake_ranks(2, 1 << 16, torch.float16, op="gemm_ar")
    me = ws[0]
    peers, sources, offsets, end = _setup(ws, 0, torch.float16, (11,), 1001)   # 22022 B
    _fill(sources, seed=3)
    me.gen.fill_(1)
    _raise_ready2(ws, 0, 1, 1)
    out = torch.zeros(end, 1001, dtype=torch.float16)
    me.gather("big", me.incoming("READY2", peers), sources, offsets, out, me.outgoing("DONE2", peers))
    assert torch.equal(_bytes(out[3:]), _bytes(sources[0])) and not out[:3].any()
    assert launched[0][0] == (3,) and _flag(ws, 1, "DONE2", 0) == 1


@pytest.mark.parametrize("missing", [0, 1])
def test_a_peer_that_never_raises_ready2_is_named_and_the_whole_output_is_nan(interp, missing):
    """Rank 0 of 3 at call 5: one peer raised READY2, the other (the first or the second waited
    for) still holds call 4's.  The record names it (WAIT_READY2, generation 5, seen 4, rank 0),
    every element of the output is NaN -- the own rows and the chunk already copied too --, no
    DONE2 is raised, the counter is back at 0; the host raises a TimeoutError naming the peer."""
    ws = fake_ranks(3, 1 << 15, torch.float16, op="gemm_ar")
    me = ws[0]
    peers, sources, offsets, end = _setup(ws, 0, torch.float16, (4, 4), 1500)   # an output of 5 blocks
    _fill(sources, seed=5)
    me.gen.fill_(5)
    for i, p in enumerate(peers):
        _raise_ready2(ws, 0, p, 4 if i == missing else 5)
    out = torch.zeros(end, 1500, dtype=torch.float16)
    me.gather("t", me.incoming("READY2", peers), sources, offsets, out, me.outgoing("DONE2", peers))
    dead = peers[missing]
    words = me.error.tolist()
    assert words[:6] == [1, abi.WAIT_READY2, dead, 5, 4, 0], words
    assert out.isnan().all()
    assert [_flag(ws, p, "DONE2", 0) for p in peers] == [0, 0] and me.gather_sync[0].item() == 0
    with pytest.raises(TimeoutError, match=rf"rank 0 waited .* for rank {dead} to publish its reduced rows"):
        me.check("gemm_ar")


def test_a_broken_workspace_fills_nan_at_once_and_raises_nothing(interp, monkeypatch):
    """The error word already set (an earlier timeout), no READY2 anywhere and a 5 s bound: the
    launch returns at once, records nothing more, raises DONE2 nowhere, and the output is NaN."""
    monkeypatch.setenv("TPFUSE_TIMEOUT_S", "5")
    symm.refresh_settings()
    ws = fake_ranks(3, 4096, torch.float32, op="gemm_ar")
    me = ws[2]
    me.error[abi.ERR_STATUS] = 1
    me.error[abi.ERR_PEER] = 7
    before = me.error.tolist()
    me.gen.fill_(3)
    peers, sources, offsets, end = _setup(ws, 2, torch.float32, (2, 2), 4)
    out = torch.zeros(end, 4)
    t0 = time.perf_counter()
    me.gather("t", me.incoming("READY2", peers), sources, offsets, out, me.outgoing("DONE2", peers))
    assert time.perf_counter() - t0 < 1.0 and me.error.tolist() == before
    assert out.isnan().all() and [_flag(ws, p, "DONE2", 2) for p in peers] == [0, 0]
    assert me.gather_sync[0].item() == 0


@pytest.mark.parametrize("shared", [False, True])
def test_the_gather_grid_is_divided_among_ranks_that_share_one_gpu(interp, monkeypatch, launched, shared):
    """As publish's: chunks big enough for PUBLISH_MAX_PROGRAMS programs get them on a GPU of
    their own, PUBLISH_MAX_PROGRAMS // W where the W ranks share one (spinning grids leave SMs)."""
    monkeypatch.setattr(symm, "PUBLISH_MAX_PROGRAMS", 8)
    if shared:
        monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    else:
        monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", raising=False)
    ws = fake_ranks(4, 8192, torch.float16, op="gemm_ar")
    me = ws[0]
    peers, sources, offsets, end = _setup(ws, 0, torch.float16, (16, 16, 16), 12)   # 384 B each
    _fill(sources, seed=6)
    me.gen.fill_(1)
    for p in peers:
        _raise_ready2(ws, 0, p, 1)
    out = torch.zeros(end, 12, dtype=torch.float16)
    me.gather("t", me.incoming("READY2", peers), sources, offsets, out, me.outgoing("DONE2", peers))
    assert launched[0][0] == ((2,) if shared else (8,))
    assert torch.equal(_bytes(out[3 + 32:]), _bytes(sources[2])) and [_flag(ws, p, "DONE2", 0) for p in peers] == [1] * 3


def test_gather_reduced_in_one_launch_is_the_reduce_then_the_gather(interp, launched):
    """fused's phase 2 (``gather_reduced(..., one_launch=True)``) on rank 0 of 2, two calls: the
    output's own rows are the float32 sum of its inbox in rank order, the peer's rows its gather
    slot bit for bit (the plan kept from the first call points at the right rows), DONE and READY2
    raised by the reduce, DONE2 by the gather -- one gather launch per call."""
    ws = fake_ranks(2, 1 << 14, torch.float16, op="gemm_ar")
    me = ws[0]
    m, n = 10, 6
    bounds = [(0, 5), (5, 10)]
    gather_at = steps.two_shot_gather_offset(me)
    sources = [me.data(0, (5, n), offset=src * 5 * n) for src in range(2)]
    slots = [me.data(owner, (5, n), offset=gather_at) for owner in range(2)]
    g = torch.Generator().manual_seed(7)
    for gen in (1, 2):
        for s in sources:
            s.copy_(torch.randn(5, n, generator=g).half())
        _fill([slots[1]], seed=10 + gen)
        me.gen.fill_(gen)
        me.flags[0][symm.flag_index("READY", 1, 2)] = gen
        me.flags[0][symm.flag_index("DONE2", 1, 2)] = gen - 1
        _raise_ready2(ws, 0, 1, gen)
        c = torch.full((m, n), -1.0, dtype=torch.float16)
        steps.gather_reduced(me, [1], sources, bounds, slots.__getitem__, c, one_launch=True)
        assert torch.equal(c[:5], (sources[0].float() + sources[1].float()).half()) and torch.equal(c[:5], slots[0])
        assert torch.equal(_bytes(c[5:]), _bytes(slots[1]))
        assert [_flag(ws, 1, region, 0) for region in ("DONE", "READY2", "DONE2")] == [gen] * 3
        assert me.error[abi.ERR_STATUS].item() == 0
    assert len(launched) == 2


def test_gather_kernel_compiles_for_sm90_with_vector_copies_and_system_scope_ordering():
    """The kernel as launched on the H200 (8 warps, blocks of 4096 4-byte elements): 16-byte vector
    loads and stores when aligned, READY2 waited with ld.acquire.sys on %globaltimer, the count an
    acq_rel GPU-scope add, DONE2 a release.sys exchange; 2-byte unaligned copies compile too."""
    from test_sm_workers_interp import _compile, skip_unless_sm90_ptx_of_triton_36

    skip_unless_sm90_ptx_of_triton_36()

    from tpfuse.gemm.offline import sass_of
    from tpfuse.kernels import flags

    i32, i64, f16 = (torch.empty(4, dtype=d) for d in (torch.int32, torch.int64, torch.float16))
    args = dict(gen_ptr=i32, sync_ptr=i32, err_ptr=i32, ready_ptr=i64, peers_ptr=i64, jobs_ptr=i64, num_peers=3,
                done_ptr=i64, num_done=3, timeout=10**10, what=abi.WAIT_READY2, rank=0, out_ptr=f16, numel=4096)
    for elem, aligned in ((4, True), (2, False)):
        kern = _compile(flags.gather_kernel, args, dict(BLOCK=4096, ELEM=elem, ALIGNED=aligned, USE_ASM=True), 8)
        ptx = kern.asm["ptx"]
        v4 = len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)), len(re.findall(r"st\.global(\.\w+)*\.v4", ptx))
        assert (v4[0] > 0 and v4[1] > 0) == aligned, v4
        assert re.search(r"ld\.global\.acquire\.sys", ptx) and "globaltimer" in ptx
        assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)
        # DONE2, and signals.record_error's release of the host mirror's status
        assert len(re.findall(r"atom\.global\.sys\.release\.exch", ptx)) == 2
        assert re.search(r"atom\.global\.acq_rel\.sys\.cas", ptx)   # record_error's CAS on the error word
        _, res = sass_of(kern.asm["cubin"])
        assert "LOCAL:0" in res and "STACK:0" in res, res      # no register spills (the cubin: ptxas ran)
