"""gemm_rs / gemm_ar's flag steps riding in the launches next to them (issue 34) under
TRITON_INTERPRET=1 on fake ranks (CPU tensors stand in for the ranks' symmetric allocations):

* the reduce's SIGNAL (DONE, two-shot: and READY2, raised by its last program) and OUT2 (the
  owner's reduced rows into its gather slot and its own output rows) -- ``Workspace.reduce``;
* two waits after a signal in one launch (two-shot gemm_ar: DONE2 credits, then the inbox's
  READY) -- ``Workspace.signal_wait(..., then=...)``;
* the NaN fill raising DONE2 -- ``Workspace.poison_on_error(..., signal=...)``.

Each: healthy (flags = the generation, outputs as before, the reduce's counter back at 0 so a
graph replay finds it so), broken (outputs NaN, nothing signalled), and for the waits a timeout
that names the peer and the wait it was.  The strategies' own calls with a dead peer (NaN, then
TimeoutError naming it) are tests/cpu/test_async_errors.py's; the sm_90 compile of the three kernels
is checked as tests/cpu/test_publish_interp.py checks the publish kernel's."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

import re  # noqa: E402

from tpfuse import symm  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402

from _symm_interp import fake_ranks, interpreted  # noqa: E402


@pytest.fixture
def interp():
    with interpreted():
        yield


def _flag(ws, owner, region, other):
    return ws[owner].flags[owner][symm.flag_index(region, other, len(ws))].item()


def _sources(ws, rows, cols, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    sources = [ws[0].data(r, (rows, cols)) for r in range(len(ws))]
    for i, s in enumerate(sources):   # magnitudes far apart: the order of the sum shows in fp32
        s.copy_((torch.randn(rows, cols, generator=g) * 10.0 ** (3 * i)).to(dtype))
    expect = sources[0].float()
    for s in sources[1:]:
        expect = expect + s.float()
    return sources, expect.to(dtype)


@pytest.mark.parametrize("rows, cols", [(5, 300), (9, 40)])   # several programs: the last one signals
def test_the_reduce_writes_both_outputs_then_its_last_program_signals_and_resets_its_counter(interp, rows, cols):
    ws = fake_ranks(3, 1 << 14, torch.float32)
    sources, expect = _sources(ws, rows, cols)
    gathered = torch.full((rows, cols), float("nan"))
    c = torch.full((rows + 3, cols), -1.0)
    for gen in (4, 5):   # twice: the counter is back at 0 for the next launch (and a graph's replay)
        ws[0].gen.fill_(gen)
        ws[0].reduce(("t", rows, cols), sources, gathered, out2=c[1:1 + rows],
                     signal=ws[0].outgoing(("DONE", "READY2"), [1, 2]))
        assert torch.equal(gathered, expect) and torch.equal(c[1:1 + rows], expect)
        assert (c[0] == -1).all() and (c[1 + rows:] == -1).all()
        assert [_flag(ws, p, reg, 0) for reg in ("DONE", "READY2") for p in (1, 2)] == [gen] * 4
        assert ws[0].reduce_sync.item() == 0 and ws[0].error[abi.ERR_STATUS].item() == 0


def test_the_reduce_checks_its_sources_once_per_key_and_shape_and_its_outputs_every_call(interp):
    """Workspace.reduce keeps what depends on the sources (views of the workspace, fixed per
    key) and the shape: a second call of the key reuses it; a call of another shape under the
    same key checks the sources against that shape again (and refuses them); the outputs'
    layout is checked on every call."""
    ws = fake_ranks(2, 1 << 14, torch.float32)
    sources, expect = _sources(ws, 6, 70)
    for _ in range(2):
        out = torch.zeros(6, 70)
        ws[0].reduce(("k", 6, 70), sources, out)
        assert torch.equal(out, expect)
    assert len(ws[0]._reduces) == 1
    with pytest.raises(AssertionError, match="one row stride"):
        ws[0].reduce(("k", 6, 70), sources, torch.zeros(5, 70))        # the sources are [6, 70]
    with pytest.raises(AssertionError, match="unit column stride"):
        ws[0].reduce(("k", 6, 70), sources, torch.zeros(70, 6).t())
    with pytest.raises(AssertionError, match="second output"):
        ws[0].reduce(("k", 6, 70), sources, torch.zeros(6, 70), out2=torch.zeros(6, 70, dtype=torch.float64))


def test_a_broken_reduce_fills_both_outputs_with_nan_and_signals_nothing(interp):
    ws = fake_ranks(2, 1 << 14, torch.float32)
    sources, _ = _sources(ws, 6, 70)
    ws[0].error[0] = 1
    ws[0].gen.fill_(3)
    gathered, c = torch.zeros(6, 70), torch.zeros(6, 70)
    ws[0].reduce(("t", 6, 70), sources, gathered, out2=c, signal=ws[0].outgoing(("DONE", "READY2"), [1]))
    assert gathered.isnan().all() and c.isnan().all()
    assert _flag(ws, 1, "DONE", 0) == 0 and _flag(ws, 1, "READY2", 0) == 0 and ws[0].reduce_sync.item() == 0


def test_an_empty_reduce_still_signals(interp):
    ws = fake_ranks(2, 4096, torch.float32)
    ws[0].gen.fill_(2)
    ws[0].reduce(("t", 0, 4), [ws[0].data(r, (0, 4)) for r in range(2)], torch.empty(0, 4),
                 signal=ws[0].outgoing("DONE", [1]))
    assert _flag(ws, 1, "DONE", 0) == 2


def test_signal_then_two_waits_in_one_launch(interp):
    ws = fake_ranks(3, 4096, torch.float32)
    for w in ws:
        w.gen.fill_(5)
    for p in (1, 2):   # DONE2 of the last call (lag 1), READY of this one
        ws[0].flags[0][symm.flag_index("DONE2", p, 3)] = 4
        ws[0].flags[0][symm.flag_index("READY", p, 3)] = 5
    ws[0].signal_wait(ws[0].outgoing("READY", [1, 2]), ws[0].incoming("DONE2", [1, 2]), symm.WAIT_CREDIT2, lag=1,
                      then=(ws[0].incoming("READY", [1, 2]), symm.WAIT_READY, 0))
    assert ws[0].error[abi.ERR_STATUS].item() == 0
    assert _flag(ws, 1, "READY", 0) == 5 and _flag(ws, 2, "READY", 0) == 5
    # no signal table: the waits alone
    ws[0].signal_wait(None, ws[0].incoming("DONE2", [1, 2]), symm.WAIT_CREDIT2, lag=1,
                      then=(ws[0].incoming("READY", [1, 2]), symm.WAIT_READY, 0))
    assert ws[0].error[abi.ERR_STATUS].item() == 0


@pytest.mark.parametrize("missing", ["DONE2", "READY"])
def test_either_wait_of_the_launch_times_out_naming_the_peer_and_the_wait(interp, missing):
    ws = fake_ranks(3, 4096, torch.float32)
    ws[0].gen.fill_(5)
    for p in (1, 2):
        ws[0].flags[0][symm.flag_index("DONE2", p, 3)] = 4
        ws[0].flags[0][symm.flag_index("READY", p, 3)] = 5
    ws[0].flags[0][symm.flag_index(missing, 2, 3)] = 0   # rank 2 never comes
    ws[0].signal_wait(None, ws[0].incoming("DONE2", [1, 2]), symm.WAIT_CREDIT2, lag=1,
                      then=(ws[0].incoming("READY", [1, 2]), symm.WAIT_READY, 0))
    words = ws[0].error.tolist()
    what, target = (symm.WAIT_CREDIT2, 4) if missing == "DONE2" else (symm.WAIT_READY, 5)
    assert words[:6] == [1, what, 2, target, 0, 0], words
    meaning = "finish reading this rank's gather buffer" if missing == "DONE2" else "publish its data"
    with pytest.raises(TimeoutError, match=rf"rank 0 waited .* for rank 2 to {meaning}.*generation >= {target}"):
        ws[0].check("gemm_ar")


def test_a_broken_signal_wait_signals_nothing_and_returns_at_once(interp):
    ws = fake_ranks(2, 4096, torch.float32)
    ws[0].error[0] = 1
    ws[0].gen.fill_(5)
    before = ws[0].error.tolist()
    ws[0].signal_wait(ws[0].outgoing("READY", [1]), ws[0].incoming("DONE2", [1]), symm.WAIT_CREDIT2, lag=1,
                      then=(ws[0].incoming("READY", [1]), symm.WAIT_READY, 0))
    assert _flag(ws, 1, "READY", 0) == 0 and ws[0].error.tolist() == before


@pytest.mark.parametrize("broken", [False, True])
def test_the_nan_fill_raises_its_signal_unless_broken(interp, broken):
    ws = fake_ranks(3, 4096, torch.float32)
    ws[0].gen.fill_(7)
    if broken:
        ws[0].error[0] = 1
    c = torch.zeros(5000, dtype=torch.float16)   # several programs: program 0 alone signals
    ws[0].poison_on_error(c, signal=ws[0].outgoing("DONE2", [1, 2]))
    assert [_flag(ws, p, "DONE2", 0) for p in (1, 2)] == ([0, 0] if broken else [7, 7])
    assert c.isnan().all() if broken else not c.any()
    # no floating output: the signal alone (its own launch)
    ws[0].poison_on_error(signal=ws[0].outgoing("DONE2", [1]))
    assert _flag(ws, 1, "DONE2", 0) == (0 if broken else 7)


def test_the_three_kernels_compile_for_sm90_with_their_ordering():
    """As launched on the H200: the reduce with OUT2 and SIGNAL (4 warps) counts its programs with an
    acq_rel GPU-scope add and signals with release.sys exchanges; the two-wait signal_wait waits with
    ld.acquire.sys; the NaN fill signals with a release.sys exchange."""
    from test_sm_workers_interp import _compile, skip_unless_sm90_ptx_of_triton_36

    skip_unless_sm90_ptx_of_triton_36()

    from tpfuse.kernels import flags
    from tpfuse.kernels.reduce import reduce_kernel

    i32, i64, f16 = (torch.empty(4, dtype=d) for d in (torch.int32, torch.int64, torch.float16))
    args = dict(table_ptr=i64, num_src=2, out_ptr=f16, rows=4, cols=8, src_stride=8, out_stride=8, err_ptr=i32,
                out2_ptr=f16, out2_stride=8, gen_ptr=i32, sync_ptr=i32, sig_table=i64, num_sig=2)
    ptx = _compile(reduce_kernel, args, dict(BLOCK_R=4, BLOCK_C=256, OUT2=True, SIGNAL=True), 4).asm["ptx"]
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx) and re.search(r"atom\.global\.sys\.release\.exch", ptx)
    assert "bar.sync" in ptx
    args = dict(gen_ptr=i32, sig_table=i64, num_sig=1, wait_table=i64, peers_ptr=i64, num_wait=1, lag=1, timeout=1,
                err_ptr=i32, what=3, rank=0, wait2_table=i64, peers2_ptr=i64, num_wait2=1, lag2=0, what2=2)
    ptx = _compile(flags.signal_wait_kernel, args, dict(USE_ASM=True), 1).asm["ptx"]
    assert len(re.findall(r"ld\.global\.acquire\.sys", ptx)) >= 2 and re.search(r"atom\.global\.sys\.release\.exch", ptx)
    args = dict(err_ptr=i32, out_ptr=f16, numel=4, out2_ptr=f16, numel2=4, zero_ptr=i32, num_zero=0, gen_ptr=i32,
                sig_table=i64, num_sig=1)
    ptx = _compile(flags.poison_on_error_kernel, args, dict(BLOCK=1024), 4).asm["ptx"]
    assert re.search(r"atom\.global\.sys\.release\.exch", ptx)
