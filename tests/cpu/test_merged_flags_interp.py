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
TimeoutError naming it) are tests/cpu/test_async_errors.py's."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

from tpfuse import symm  # noqa: E402
from tpfuse.kernels import abi  # noqa: E402

from _symm_interp import fake_ranks, interpreted  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
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
def test_the_reduce_writes_both_outputs_then_its_last_program_signals_and_resets_its_counter(rows, cols):
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


def test_a_broken_reduce_fills_both_outputs_with_nan_and_signals_nothing():
    ws = fake_ranks(2, 1 << 14, torch.float32)
    sources, _ = _sources(ws, 6, 70)
    ws[0].error[0] = 1
    ws[0].gen.fill_(3)
    gathered, c = torch.zeros(6, 70), torch.zeros(6, 70)
    ws[0].reduce(("t", 6, 70), sources, gathered, out2=c, signal=ws[0].outgoing(("DONE", "READY2"), [1]))
    assert gathered.isnan().all() and c.isnan().all()
    assert _flag(ws, 1, "DONE", 0) == 0 and _flag(ws, 1, "READY2", 0) == 0 and ws[0].reduce_sync.item() == 0


def test_an_empty_reduce_still_signals():
    ws = fake_ranks(2, 4096, torch.float32)
    ws[0].gen.fill_(2)
    ws[0].reduce(("t", 0, 4), [ws[0].data(r, (0, 4)) for r in range(2)], torch.empty(0, 4),
                 signal=ws[0].outgoing("DONE", [1]))
    assert _flag(ws, 1, "DONE", 0) == 2


def test_signal_then_two_waits_in_one_launch():
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
def test_either_wait_of_the_launch_times_out_naming_the_peer_and_the_wait(missing):
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


def test_a_broken_signal_wait_signals_nothing_and_returns_at_once():
    ws = fake_ranks(2, 4096, torch.float32)
    ws[0].error[0] = 1
    ws[0].gen.fill_(5)
    before = ws[0].error.tolist()
    ws[0].signal_wait(ws[0].outgoing("READY", [1]), ws[0].incoming("DONE2", [1]), symm.WAIT_CREDIT2, lag=1,
                      then=(ws[0].incoming("READY", [1]), symm.WAIT_READY, 0))
    assert _flag(ws, 1, "READY", 0) == 0 and ws[0].error.tolist() == before


@pytest.mark.parametrize("broken", [False, True])
def test_the_nan_fill_raises_its_signal_unless_broken(broken):
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
