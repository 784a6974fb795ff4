"""Timelines: the record format, the recorder switch, Chrome-trace and PNG output, and the ring's
per-step spans recorded on gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

from tpfuse import timeline
from tpfuse.timeline import TimelineEvent


def test_recorder_is_off_by_default_and_one_at_a_time():
    assert timeline.current() is None
    with timeline.recording(rank=3) as rec:
        assert timeline.current() is rec
        with pytest.raises(RuntimeError, match="already active"):
            with timeline.recording():
                pass
        with rec.span("gemm", "chunk 1", chunk=1):
            torch.ones(64, 64) @ torch.ones(64, 64)
        rec.add_raw("copy", "tile 7", 5, 9, chunk=0, tile=7)
    assert timeline.current() is None
    events = rec.events()
    assert [(e.rank, e.lane, e.chunk) for e in events] == [(3, "copy", 0), (3, "gemm", 1)]  # sorted by start
    gemm = events[1]
    assert gemm.end_ns >= gemm.start_ns > 9
    with pytest.raises(ValueError, match="before start_ns"):
        rec.add_raw("copy", "bad", 10, 9)


def test_device_record_buffers_come_in_with_an_offset():
    with timeline.recording(rank=1) as rec:
        rec.add_records("gemm", "tile", torch.tensor([[100, 150, 0, 5], [160, 200, -1, 6]]), offset_ns=1000)
        rec.add_records("copy", "chunk", [(10, 20)])
        with pytest.raises(ValueError, match="each record is"):
            rec.add_records("copy", "bad", [(1, 2, 3, 4, 5)])
    assert [(e.lane, e.start_ns, e.end_ns, e.chunk, e.tile, e.rank) for e in rec.events()] == [
        ("copy", 10, 20, None, None, 1), ("gemm", 1100, 1150, 0, 5, 1), ("gemm", 1160, 1200, None, 6, 1)]


def test_chrome_trace_is_perfetto_shaped():
    events = [TimelineEvent(0, "gemm", "g0", 1_000, 3_000, chunk=0), TimelineEvent(1, "copy", "c1", 2_000, 2_500, 1, 4),
              TimelineEvent(1, "custom", "x", 4_000, 4_001)]
    trace = to_json_and_back(timeline.to_chrome_trace(events, meta={"cell": "c"}))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["cat"], e["ts"], e["dur"]) for e in spans] == [(0, "gemm", 0.0, 2.0), (1, "copy", 1.0, 0.5),
                                                                         (1, "custom", 3.0, 0.001)]
    assert spans[1]["args"] == {"chunk": 1, "tile": 4} and spans[0]["args"] == {"chunk": 0}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[(1, spans[1]["tid"])] == "copy" and names[(1, spans[2]["tid"])] == "custom"
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {"rank 0", "rank 1"}
    assert trace["otherData"] == {"cell": "c"}
    assert [TimelineEvent.from_dict(e.to_dict()) for e in events] == events


def to_json_and_back(d):
    return json.loads(json.dumps(d))


def test_draw_writes_a_png_per_call_panel(tmp_path):
    events = [TimelineEvent(r, "call", s, t, t + 100) for r in (0, 1) for s, t in (("unfused", 0), ("ring", 200))]
    events += [TimelineEvent(0, "gemm", "g", 210, 250, chunk=0), TimelineEvent(1, "wait", "w", 205, 220, chunk=1)]
    panels = timeline._panels(events)
    assert [name for name, _ in panels] == ["unfused", "ring"]
    assert {e.lane for e in panels[1][1]} == {"call", "gemm", "wait"} and {e.lane for e in panels[0][1]} == {"call"}
    path = timeline.draw(events, tmp_path / "t.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no events"):
        timeline.draw([], tmp_path / "empty.png")


def ring_under_recording(rank, world_size):
    import tpfuse

    out = {}
    for op in ("ag_gemm", "gemm_rs"):
        m = 4 * world_size
        a = torch.randn(m // world_size if op == "ag_gemm" else m, 8, dtype=torch.float64)
        b = torch.randn(8, 5, dtype=torch.float64)
        with timeline.recording() as rec:
            getattr(tpfuse, op)(a, b, strategy="ring")
        out[op] = [e.to_dict() for e in rec.events()]
    return out


def test_ring_records_its_steps(rank_pool):
    world_size = 3
    per_rank = rank_pool(world_size).run(ring_under_recording, timeout=120)
    for op in ("ag_gemm", "gemm_rs"):
        for rank, result in enumerate(per_rank):
            events = [TimelineEvent.from_dict(e) for e in result[op]]
            assert {e.rank for e in events} == {rank}
            gemm = [e.chunk for e in events if e.lane == "gemm"]
            assert sorted(gemm) == list(range(world_size)), (op, gemm)  # one GEMM per chunk
            if op == "ag_gemm":
                assert gemm[0] == rank  # own rows first
            copies = [e for e in events if e.lane == "copy"]
            assert len(copies) == world_size - 1 and all(e.end_ns >= e.start_ns for e in copies)
            assert len([e for e in events if e.lane == "wait"]) == world_size - 1
            assert len([e for e in events if e.lane == "reduce"]) == (world_size - 1 if op == "gemm_rs" else 0)


def test_tile_records_become_chunk_lanes_and_waits_anchored_at_the_launch():
    """Recorder.add_tile_records: one span per written row (lane of its chunk), its wait part in
    "tile waits", unwritten rows (-1) dropped, the earliest tile start placed at the anchor."""
    import types

    from tpfuse import timeline
    from tpfuse.kernels import abi

    rec = timeline.Recorder(rank=3)
    records = torch.full((6, abi.TILE_RECORD_COLUMNS), -1, dtype=torch.int64)
    # a 3 x 2 grid of 64 x 64 tiles over 192 rows, chunks of 96 rows: tile t's rows start at (t // 2) * 64
    for t, (start, wait, end) in {0: (1000, 1000, 1500), 3: (1100, 1400, 1900), 5: (1200, 1700, 2500)}.items():
        records[t, abi.REC_TILE], records[t, abi.REC_START_NS] = t, start
        records[t, abi.REC_WAIT_NS], records[t, abi.REC_END_NS] = wait, end
    plan = types.SimpleNamespace(tile_shape=(64, 64), tile_grid=(3, 2))
    rec.add_tile_records(records, plan, 96, anchor=50_000)
    evs = rec.events()
    tiles = {ev.tile: ev for ev in evs if ev.lane.startswith("tiles")}
    waits = {ev.tile: ev for ev in evs if ev.lane == "tile waits"}
    assert sorted(tiles) == [0, 3, 5] and sorted(waits) == [3, 5]     # tile 0 did not wait
    assert tiles[0].start_ns == 50_000 and tiles[5].end_ns - tiles[5].start_ns == 1300
    assert [tiles[t].chunk for t in (0, 3, 5)] == [0, 0, 1]            # rows 0, 64, 128 -> chunks 0, 0, 1
    assert tiles[5].lane == "tiles chunk 01" and waits[3].end_ns - waits[3].start_ns == 300
    assert all(ev.rank == 3 for ev in evs)
