"""The symmetric-memory workspace on CPU: flag kernels and the reduce kernel under
TRITON_INTERPRET=1 on plain tensors standing in for the ranks' allocations, capacity growth,
broken-workspace handling, and copy_engine's refusal on CPU groups.  The protocol itself runs
on the GPU bed (tests/gpu/bed.py)."""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

from tpfuse import symm  # noqa: E402
from tpfuse.strategies import copy_engine  # noqa: E402

from _symm_interp import fake_ranks, interpreted  # noqa: E402

@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    """Run the kernels under TRITON_INTERPRET=1 (decorated afresh, and dropped after)."""
    with interpreted():
        yield


def _ranks(world_size: int, capacity: int = 4096, dtype=torch.float32, op="gemm_rs"):
    """One Workspace per rank over shared CPU buffers (rank r's buffer is buffers[r] for all)."""
    return fake_ranks(world_size, capacity, dtype, op)


def test_signal_writes_the_generation_into_each_peers_word():
    ws = _ranks(3)
    ws[1].gen.fill_(5)
    ws[1].signal(ws[1].outgoing("READY", [2, 0]))
    assert ws[0].flags[0][symm.flag_index("READY", 1, 3)].item() == 5
    assert ws[0].flags[2][symm.flag_index("READY", 1, 3)].item() == 5
    assert ws[0].flags[1].abs().sum().item() == 0       # its own words untouched
    assert ws[0].flags[0].sum().item() == 5             # nothing else written


def test_begin_advances_and_waits_for_credits_of_the_previous_call():
    ws = _ranks(2)
    credits = ws[0].incoming("DONE", [1])
    ws[0].begin(credits)                 # gen 1 needs DONE >= 0: passes at once
    assert ws[0].gen.item() == 1 and ws[0].error[0].item() == 0
    ws[1].gen.fill_(1)
    ws[1].signal(ws[1].outgoing("DONE", [0]))
    ws[0].begin(credits)                 # gen 2 needs DONE >= 1: there
    assert ws[0].gen.item() == 2 and ws[0].error[0].item() == 0
    ws[0].check("gemm_rs")


def test_wait_times_out_records_who_and_breaks_the_workspace():
    ws = _ranks(3)
    ws[0].gen.fill_(3)
    ws[2].gen.fill_(3)
    ws[2].signal(ws[2].outgoing("READY", [0]))
    ws[0].wait(ws[0].incoming("READY", [2, 1]), symm.WAIT_READY)     # rank 1 never signals
    words = ws[0].error.tolist()
    assert words[:6] == [1, symm.WAIT_READY, 1, 3, 0, 0]
    with pytest.raises(TimeoutError, match=r"rank 0 waited .* for rank 1 to publish its data .*generation >= 3"):
        ws[0].check("ag_gemm")
    with pytest.raises(RuntimeError, match="broken by an earlier timeout"):
        ws[0].begin(ws[0].incoming("DONE", [1, 2]))


def test_a_failed_wait_stops_the_later_waits_of_the_call():
    ws = _ranks(2)
    ws[0].error[0] = 1
    ws[0].gen.fill_(7)
    ws[0].wait(ws[0].incoming("READY", [1]), symm.WAIT_READY)    # would spin its whole bound
    assert ws[0].error.tolist()[1] == 0                          # returned without recording


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_sums_in_float32_in_table_order_and_rounds_once(dtype):
    world_size, rows, cols = 4, 5, 300
    ws = _ranks(world_size, capacity=1 << 14, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    sources = [ws[0].data(r, (rows, cols)) for r in range(world_size)]
    for i, s in enumerate(sources):   # magnitudes far apart: the order of the sum shows in fp32
        s.copy_((torch.randn(rows, cols, generator=g) * 10.0 ** (3 * i)).to(dtype))
    out = torch.full((rows, cols), float("nan"), dtype=dtype)
    ws[0].reduce(("t", rows, cols), sources, out)
    expect = sources[0].float()
    for s in sources[1:]:
        expect = expect + s.float()
    if dtype == torch.float32:
        assert torch.equal(out, expect)
        assert not torch.equal(out, sum(s.float() for s in reversed(sources)))   # the order is seen
    else:   # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest: one bf16 ulp apart at most
        assert torch.allclose(out.float(), expect, rtol=2 ** -7, atol=0)
    again = torch.empty_like(out)
    ws[1].reduce(("t", rows, cols), [ws[1].data(r, (rows, cols)) for r in range(world_size)], again)
    assert torch.equal(again, out)          # another rank, same order: bitwise the same


def test_data_views_address_each_ranks_region_and_refuse_overflow():
    ws = _ranks(2, capacity=1024)
    ws[0].data(1, (4, 8), offset=8).fill_(3.0)
    assert ws[1].data(1, (32,), offset=8)[:32].sum().item() == 3.0 * 32
    assert ws[1].data(0, (4, 8)).abs().sum().item() == 0
    with pytest.raises(AssertionError, match="exceeds"):
        ws[0].data(0, (16, 17))


def test_flag_indices_are_checked_to_fit():
    assert symm.flag_index("DONE2", symm.MAX_WORLD_SIZE - 1, symm.MAX_WORLD_SIZE) == symm.FLAG_WORDS - 1
    with pytest.raises(AssertionError):
        symm.flag_index("READY", 3, 3)


class _Ctx:
    group_name, rank, world_size, group = "fake", 0, 2, None


def test_workspace_grows_to_a_power_of_two_retires_the_old_and_releases(monkeypatch):
    made = []

    def fake_allocate(spec, group):
        made.append(spec.capacity)
        return _ranks(spec.world_size, spec.capacity)[spec.rank]

    monkeypatch.setattr(symm, "_allocate", fake_allocate)
    monkeypatch.setattr(symm.weakref, "finalize", lambda *a: None)
    symm.release_workspaces()
    dev = torch.device("cpu")
    small = symm.get_workspace(_Ctx, "ag_gemm", torch.float32, dev, 100)
    assert symm.get_workspace(_Ctx, "ag_gemm", torch.float32, dev, symm._MIN_CAPACITY) is small
    big = symm.get_workspace(_Ctx, "ag_gemm", torch.float32, dev, 3 * symm._MIN_CAPACITY)
    assert made == [symm._MIN_CAPACITY, 4 * symm._MIN_CAPACITY] and big is not small
    assert small in symm._RETIRED            # kept: peers may still be reading it
    other = symm.get_workspace(_Ctx, "gemm_rs", torch.float32, dev, 100)
    assert other is not big                  # one workspace per op
    big.broken = "broken: call tpfuse.release_workspaces()"
    with pytest.raises(RuntimeError, match="release_workspaces"):
        symm.get_workspace(_Ctx, "ag_gemm", torch.float32, dev, 100)
    symm.release_workspaces()
    assert not symm._LIVE and not symm._RETIRED
    assert symm.get_workspace(_Ctx, "ag_gemm", torch.float32, dev, 100).broken is None


def test_timeout_setting(monkeypatch):
    for raw, ok in (("2.5", 2.5), ("abc", None), ("0", None)):
        monkeypatch.setenv("TPFUSE_TIMEOUT_S", raw)
        symm.timeout_s.cache_clear()
        if ok is None:
            with pytest.raises(ValueError, match="TPFUSE_TIMEOUT_S"):
                symm.timeout_s()
        else:
            assert symm.timeout_s() == ok
    monkeypatch.delenv("TPFUSE_TIMEOUT_S")
    symm.timeout_s.cache_clear()
    assert symm.timeout_s() == 10.0
    monkeypatch.setenv("TPFUSE_TIMEOUT_S", "0.05")
    symm.timeout_s.cache_clear()


def test_copy_engine_availability_says_why():
    class Ctx:
        backend, world_size = "gloo", 2

    assert "needs CUDA symmetric memory" in copy_engine.why_unavailable(Ctx, torch.device("cpu"), torch.float32)
    assert "float64" in copy_engine.why_unavailable(Ctx, torch.device("cuda", 0), torch.float64)
    assert copy_engine.ar_mode(128, 4096, 2) == "one_shot"
    assert copy_engine.ar_mode(4096, 4096, 2) == "two_shot"


def test_two_shot_gemm_ar_layout_keeps_inboxes_and_gather_slot_apart_whatever_the_shapes():
    """copy_engine/fused two-shot gemm_ar: the gather slot's offset depends on the capacity only,
    so for any two calls that fit one workspace, the first's gather slot (peers may still read it)
    never overlaps the second's inboxes (peers write them once its DONE credit is in)."""
    import types

    from tpfuse.strategies import copy_engine

    for world_size in (2, 3, 4, 8):
        for dtype in (torch.bfloat16, torch.float32):
            e = torch.empty((), dtype=dtype).element_size()
            slots = [1, 7, 37 * 771, 4096 * 129, 2**20]
            for big in slots:
                need = 2 * (world_size * big + 8) * e
                cap = symm._next_capacity(need, 0)
                ws = types.SimpleNamespace(spec=types.SimpleNamespace(capacity=cap, dtype=dtype))
                gather = copy_engine.two_shot_gather_offset(ws)
                assert gather % 8 == 0
                for slot in slots:
                    if 2 * (world_size * slot + 8) * e > cap:
                        continue
                    assert world_size * slot <= gather            # inboxes below the gather slot
                    assert (gather + slot) * e <= cap             # the gather slot fits


def test_release_frees_workspaces_their_plans_hold_without_the_cycle_collector(monkeypatch):
    """A workspace's plans name it (their prepared launches), a cycle: release_workspaces drops
    it and its buffers at once, after its device sync, not when Python's collector next runs
    (inside some later call)."""
    import gc
    import weakref

    monkeypatch.setattr(symm, "_allocate", lambda spec, group: _ranks(spec.world_size, spec.capacity)[spec.rank])
    monkeypatch.setattr(symm.weakref, "finalize", lambda *a: None)
    monkeypatch.setattr(symm.gc, "collect", lambda: 0)   # what close() alone frees
    symm.release_workspaces()
    dev = torch.device("cpu")
    ws = symm.get_workspace(_Ctx, "gemm_rs", torch.float32, dev, 256)
    ws.state["plan"] = ws.reducer(("rs", 4, 8), [ws.data(0, (4, 8)), ws.data(1, (4, 8))], (4, 8))
    alive = weakref.ref(ws)
    buffer = weakref.ref(ws._buffers[0])
    del ws
    gc.disable()
    try:
        symm.release_workspaces()
        assert alive() is None and buffer() is None
    finally:
        gc.enable()
    ws = symm.get_workspace(_Ctx, "gemm_rs", torch.float32, dev, 256)
    kept = ws
    symm.release_workspaces()
    with pytest.raises(RuntimeError, match="released"):   # a workspace held past its release refuses calls
        kept.check("gemm_rs")
