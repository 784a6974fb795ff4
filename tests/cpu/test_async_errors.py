"""Errors without a device sync (issue 34): the broken-word path of the flag, reduce and NaN-fill
kernels and of the GEMM's wait hook under TRITON_INTERPRET=1, the host-visible error record
(a CPU tensor standing in for the pinned mirror) read with no sync, the watchdog driven by a fake
record, and ``tpfuse.synchronize`` / the next call raising.  What only the GPU bed proves (pinned
memory written through UVA by a real kernel, the watchdog's line in a dying run, NaN outputs of
queued calls across processes): tests/gpu/bed.py, case ``queued_after_timeout``."""
from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

import tpfuse  # noqa: E402
from tpfuse import symm, watchdog  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402

from _symm_interp import dead_peer_workspaces, fake_cuda_streams, fake_ranks, interpreted  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    with interpreted():
        yield


def _timed_out(ws):
    """A READY wait on rank 1 that never comes: ws[0]'s word is set, as on a dead peer."""
    ws[0].gen.fill_(3)
    ws[0].wait(ws[0].incoming("READY", [1]), symm.WAIT_READY)
    assert ws[0].error[abi.ERR_STATUS].item() == 1


def test_a_timeout_lands_in_the_host_record_with_the_facts():
    ws = fake_ranks(2, 4096, torch.float32)
    assert not ws[0].host.failed()
    # the device word carries the mirror's address
    assert ws[0].error.view(torch.int64)[abi.ERR_MIRROR // 2].item() == ws[0].host.address
    _timed_out(ws)
    assert ws[0].host.failed()
    assert ws[0].host.record() == ws[0].error[:abi.ERR_RECORD_WORDS].tolist()
    rec = ws[0].host.record()
    assert rec[abi.ERR_WHAT] == abi.WAIT_READY and rec[abi.ERR_PEER] == 1 and rec[abi.ERR_RANK] == 0
    assert rec[abi.ERR_GENERATION] == 3 and rec[abi.ERR_SEEN] == 0
    assert "rank 0 waited more than" in ws[0].host.message() and "for rank 1 to publish its data" in ws[0].host.message()


def test_the_host_reads_the_record_without_touching_the_device_word(monkeypatch):
    """check() reads the mirror only: a device word that cannot be read (as if it were on a
    busy GPU) is never read."""
    ws = fake_ranks(2, 4096, torch.float32)
    _timed_out(ws)

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the host read the device error word ({name})")

    ws[0].error = Untouchable()
    with pytest.raises(TimeoutError, match=r"rank 0 waited .* for rank 1 to publish its data .*generation >= 3"):
        ws[0].check("ag_gemm")
    with pytest.raises(RuntimeError, match="broken by an earlier timeout"):
        ws[0].check("ag_gemm")


def test_a_broken_word_stops_waits_signals_and_fills_nan():
    ws = fake_ranks(2, 4096, torch.float32)
    _timed_out(ws)
    # a wait returns at once without recording (it would spin its whole bound otherwise)
    before = ws[0].error.tolist()
    t0 = time.perf_counter()
    ws[0].wait(ws[0].incoming("DONE", [1]), symm.WAIT_CREDIT)
    assert ws[0].error.tolist() == before and time.perf_counter() - t0 < 0.5
    # a signal writes nothing: the peer times out instead of reading unguarded data
    ws[0].signal(ws[0].outgoing("READY", [1]))
    assert ws[1].flags[1][symm.flag_index("READY", 0, 2)].item() == 0
    # signal + wait in one launch: neither
    ws[0].signal_wait(ws[0].outgoing("DONE", [1]), ws[0].incoming("READY", [1]), symm.WAIT_READY)
    assert ws[1].flags[1][symm.flag_index("DONE", 0, 2)].item() == 0 and ws[0].error.tolist() == before
    # the reduce is the NaN fill of gemm_rs
    src = [ws[0].data(r, (3, 5)) for r in range(2)]
    for s in src:
        s.fill_(1.0)
    out = torch.zeros(3, 5)
    ws[0].reduce(("t", 3, 5), src, out)
    assert out.isnan().all()
    # the poison kernel, two outputs a launch (one larger than its grid x block), and a third
    c = torch.zeros(7, 3, dtype=torch.bfloat16)
    a_full = torch.zeros(70_000, dtype=torch.bfloat16)
    third = torch.zeros(5, dtype=torch.float16)
    ws[0].poison_on_error(c, a_full, third, torch.zeros(3, dtype=torch.int32))
    assert c.isnan().all() and a_full.isnan().all() and third.isnan().all()


def test_a_healthy_word_passes_everything_through():
    ws = fake_ranks(2, 4096, torch.float32)
    ws[0].gen.fill_(4)
    ws[1].gen.fill_(4)
    ws[1].signal_wait(ws[1].outgoing("READY", [0]), ws[1].incoming("DONE", [0]), symm.WAIT_CREDIT, lag=4)
    assert ws[0].flags[0][symm.flag_index("READY", 1, 2)].item() == 4 and ws[1].error[0].item() == 0
    c = torch.zeros(9, dtype=torch.float16)
    ws[0].poison_on_error(c)
    src = [ws[0].data(r, (2, 4)) for r in range(2)]
    for i, s in enumerate(src):
        s.fill_(i + 1.0)
    out = torch.zeros(2, 4)
    ws[0].reduce(("t", 2, 4), src, out)
    assert torch.equal(c, torch.zeros(9, dtype=torch.float16)) and torch.equal(out, torch.full((2, 4), 3.0))


def test_the_gemm_wait_hook_records_into_the_workspace_word_and_its_mirror():
    """fused ag_gemm passes the workspace's word to the GEMM's wait hook: a chunk that never
    lands is recorded in abi.py's one layout and copied to the host record."""
    from tpfuse.gemm import GemmConfig, WaitSpec, matmul

    ws = fake_ranks(2, 4096, torch.float16)[1]
    cfg = GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)
    a = torch.randn(32, 16).half()
    b = torch.randn(16, 16).half()
    arrived = torch.tensor([1, 0], dtype=torch.int32)
    matmul(a, b, out=torch.empty(32, 16, dtype=torch.float16), config=cfg, tile_order="round", start_chunk=1,
           wait=WaitSpec(signal=arrived, generation=1, chunk_m=16, max_spins=20, error=ws.error, rank=1),
           num_sms=1, check=False)
    rec = ws.host.record()
    assert rec[abi.ERR_STATUS] == 1 and rec[abi.ERR_WHAT] == abi.WAIT_GEMM_CHUNK and rec[abi.ERR_CHUNK] == 1
    assert rec[abi.ERR_GENERATION] == 1 and rec[abi.ERR_SEEN] == 0 and rec[abi.ERR_PEER] == -1
    ws.host.chunk_owner = lambda chunk: chunk * 16 // 16   # one chunk per rank
    with pytest.raises(TimeoutError, match=r"rank 1's GEMM .* for chunk 1 of its input .*rank 1, whose rows"):
        ws.check("ag_gemm")


def _fake_record(op="gemm_rs", rank=2, group="g"):
    return watchdog.HostRecord(torch.zeros(abi.ERROR_WORDS, dtype=torch.int32), op=op, group=group, rank=rank,
                               timeout_s=0.5)


def _set(record, peer=3):
    words = record.words
    words[abi.ERR_WHAT], words[abi.ERR_PEER], words[abi.ERR_GENERATION] = abi.WAIT_READY, peer, 7
    words[abi.ERR_SEEN], words[abi.ERR_RANK] = 6, record.rank
    words[abi.ERR_STATUS] = 1


def test_the_watchdog_reports_each_error_once_naming_the_ranks():
    lines = []
    dog = watchdog.Watchdog(interval=0.01, emit=lines.append)
    healthy, failing = _fake_record(), _fake_record(rank=0)
    dog.watch(healthy)
    dog.watch(failing)
    assert dog.poll() == []
    _set(failing, peer=1)
    assert len(dog.poll()) == 1 and dog.poll() == []
    assert len(lines) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("tpfuse watchdog: tpfuse gemm_rs: rank 0 waited more than 0.5 s")
    assert "for rank 1 to publish its data" in lines[0] and "generation >= 7, last saw 6" in lines[0]
    assert "NaN" in lines[0] and "release_workspaces" in lines[0]
    del failing   # held weakly: a released workspace drops out
    assert len(dog._live()) == 1


def test_a_strategy_explains_its_own_wait_codes_and_cannot_take_anothers(monkeypatch):
    """watchdog.register_wait: the sentence for a code a strategy owns comes from that strategy
    (sm_workers registers its ring waits at import); a code already taken is refused."""
    monkeypatch.setattr(watchdog, "WAIT_KINDS", dict(watchdog.WAIT_KINDS))
    monkeypatch.setattr(watchdog, "_EXPLAIN", dict(watchdog._EXPLAIN))
    assert abi.WAIT_SLOT_FREE in watchdog._EXPLAIN and abi.WAIT_SLOT_READY in watchdog._EXPLAIN
    code = 99
    watchdog.register_wait(code, "toy", "the toy to finish", lambda words, *, op, waiter, timeout_s:
                           f"{op}: rank {waiter} waited {timeout_s:g} s for the toy (peer {words[abi.ERR_PEER]})")
    words = [0] * abi.ERROR_WORDS
    words[abi.ERR_WHAT], words[abi.ERR_PEER], words[abi.ERR_RANK] = code, 3, 1
    assert watchdog.describe(words, op="gemm_rs", rank=0, timeout_s=2.0) == "gemm_rs: rank 1 waited 2 s for the toy (peer 3)"
    for taken in (abi.WAIT_READY, abi.WAIT_GEMM_CHUNK, abi.WAIT_SLOT_FREE):
        with pytest.raises(ValueError, match="taken"):
            watchdog.register_wait(taken, "toy", "the toy to finish", lambda words, **kw: "")


def test_the_watchdog_thread_logs_within_its_interval():
    got = threading.Event()
    lines = []

    def emit(line):
        lines.append(line)
        got.set()

    dog = watchdog.Watchdog(interval=0.02, emit=emit)
    record = _fake_record()
    dog.watch(record)
    dog.start()
    time.sleep(0.05)
    assert not lines
    _set(record)
    assert got.wait(2.0), "the watchdog thread did not report"
    time.sleep(0.1)
    assert len(lines) == 1 and "rank 2 waited" in lines[0]


def test_the_default_emit_writes_one_line_to_stderr_or_to_configured_logging(capsys, caplog, monkeypatch):
    watchdog._emit("tpfuse watchdog: one")               # pytest's handlers: logging configured
    assert [r.getMessage() for r in caplog.records] == ["tpfuse watchdog: one"]
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(watchdog.log, "propagate", False)   # no handler anywhere: stderr
    watchdog._emit("tpfuse watchdog: two")
    assert capsys.readouterr().err == "tpfuse watchdog: two\n"


class _Ctx:
    group_name, rank, world_size, group = "gA", 0, 2, None


def test_the_next_call_on_the_group_and_synchronize_raise(monkeypatch):
    monkeypatch.setattr(symm, "_allocate", lambda spec, group: fake_ranks(spec.world_size, spec.capacity,
                                                                           spec.dtype, spec.op)[spec.rank])
    monkeypatch.setattr(symm.weakref, "finalize", lambda *a: None)
    symm.release_workspaces()
    dev = torch.device("cpu")
    try:
        ag = symm.get_workspace(_Ctx, "ag_gemm", torch.float32, dev, 100)
        symm.get_workspace(_Ctx, "gemm_rs", torch.float32, dev, 100)
        tpfuse.synchronize()                       # nothing failed
        _set(ag.host, peer=1)                      # a kernel of ag_gemm recorded a timeout
        other = type("G", (), {"group_name": "gB"})()
        tpfuse.synchronize(other)                  # another group: fine
        with pytest.raises(TimeoutError, match=r"tpfuse gemm_rs \(after ag_gemm\): rank 0 waited .* for rank 1"):
            symm.get_workspace(_Ctx, "gemm_rs", torch.float32, dev, 100)   # the next call, another op
        with pytest.raises(TimeoutError, match="release_workspaces"):   # seen before: still a TimeoutError
            tpfuse.synchronize()
        with pytest.raises(TimeoutError, match="release_workspaces"):
            tpfuse.check_workspaces()
        with pytest.raises(RuntimeError, match="broken by an earlier timeout"):   # a call: refused
            symm.get_workspace(_Ctx, "ag_gemm", torch.float32, dev, 100)
        symm.release_workspaces()
        assert not symm.get_workspace(_Ctx, "ag_gemm", torch.float32, dev, 100).failed()
        fresh = symm.get_workspace(_Ctx, "gemm_rs", torch.float32, dev, 100)
        _set(fresh.host)
        with pytest.raises(TimeoutError, match="rank 0 waited"):
            tpfuse.synchronize()
    finally:
        symm.release_workspaces()


@pytest.mark.parametrize("strategy, op", [("copy_engine", "gemm_rs"), ("copy_engine", "ag_gemm"),
                                          ("copy_engine", "gemm_ar"), ("copy_engine", "gemm_ar two_shot"),
                                          ("fused", "gemm_rs"), ("fused", "ag_gemm"), ("fused", "gemm_ar two_shot")])
def test_a_call_whose_peer_is_dead_returns_nan_then_the_next_call_raises(monkeypatch, strategy, op):
    """The strategy's own code on rank 0 of 2 under the interpreter (streams faked: one CPU
    "stream"), rank 1 dead: the call returns without raising and its outputs are NaN; a call
    queued after it (issued before the host looked) returns at once, NaN too; then the next
    call on the group raises TimeoutError naming rank 1; after release_workspaces calls work."""
    import types

    from tpfuse.strategies import copy_engine, fused

    fake_cuda_streams(monkeypatch)
    monkeypatch.setattr(fused, "sm_budget", lambda device, w, knobs=None: 2)
    monkeypatch.setattr(fused, "chunks_per_rank", lambda *a: 1)
    monkeypatch.setattr(fused, "_set_word", lambda words, i, stream: words.words.__setitem__(i, 1))   # the stream memory op
    op, _, mode = op.partition(" ")
    if mode:
        monkeypatch.setattr(copy_engine, "ar_mode", lambda *a: mode)
    made, checking = dead_peer_workspaces(monkeypatch)
    ctx = types.SimpleNamespace(rank=0, world_size=2, group_name="deadpeer", group=None)
    module = {"copy_engine": copy_engine, "fused": fused}[strategy]
    g = torch.Generator().manual_seed(1)
    a = torch.randn(32 if op != "ag_gemm" else 16, 16, generator=g).half()
    b = torch.randn(16, 24, generator=g).half()
    fn = getattr(module, op)
    symm.release_workspaces()
    try:
        t0 = time.perf_counter()
        first = fn(a, b, ctx)
        queued = fn(a, b, ctx)
        for out in (first, queued):
            for x in (out if isinstance(out, tuple) else (out,)):
                assert x.isnan().all(), f"{strategy} {op}: an output of a call of a broken workspace is not NaN"
        assert time.perf_counter() - t0 < 30
        checking[0] = True
        with pytest.raises(TimeoutError, match=r"rank 0 waited more than .* for rank 1"):
            fn(a, b, ctx)
        symm.release_workspaces()
        made.clear()
        assert not symm.get_workspace(ctx, op, a.dtype, a.device, 16).failed()
    finally:
        symm.release_workspaces()
