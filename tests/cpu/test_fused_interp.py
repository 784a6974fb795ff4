"""The fused strategy's index and owner arithmetic under TRITON_INTERPRET=1, on CPU tensors
standing in for W ranks' symmetric allocations (tpfuse/symm.py), signals pre-set where a peer
would raise them.  The protocol itself runs on the GPU bed (tests/gpu/bed.py)."""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

from tpfuse import symm, testing  # noqa: E402
from tpfuse.gemm import GemmConfig, WaitSpec, last_plan, matmul  # noqa: E402
from tpfuse.strategies import fused  # noqa: E402
from tpfuse.strategies._symm_steps import row_bounds  # noqa: E402

from _symm_interp import fake_ranks, interpreted  # noqa: E402

CFG = GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    with interpreted():
        yield


KNOBS = fused.FusedKnobs(num_sms=2)   # 2 programs: each loops over several tiles


class _Ctx:
    def __init__(self, rank, world_size):
        self.rank, self.world_size, self.group_name = rank, world_size, "fake"


@pytest.mark.parametrize("world_size, shard, n, k", [(2, 37, 24, 40), (3, 16, 33, 20)])
def test_fused_gemm_rs_routes_every_owners_rows_to_its_inbox_and_reduces_in_rank_order(world_size, shard, n, k):
    """fused._fused_partials on every rank (one owner-order GEMM whose epilogue stores into the
    owners' inbox slots), READY to every owner, then each owner's wait and fp32 reduce:
    the reduce-scatter of the W products.  Shards of 37 rows: tiles straddle owners.  float16:
    the interpreter rounds float32 -> bfloat16 toward zero (the GPU to nearest)."""
    dtype = torch.float16
    m = world_size * shard
    ws = fake_ranks(world_size, world_size * shard * n * 2, dtype)
    g = torch.Generator().manual_seed(world_size)
    a = [torch.randn(m, k, generator=g).to(dtype) for _ in range(world_size)]
    b = [torch.randn(n, k, generator=g).to(dtype).t() for _ in range(world_size)]   # weight.t()
    bounds = [(r * shard, (r + 1) * shard) for r in range(world_size)]
    for w in ws:
        w.gen.fill_(1)
        w.data(w.rank, (world_size * shard * n,)).fill_(float("nan"))   # poisoned inboxes
    sources = {}
    for r in range(world_size):
        plan = fused._PartialsPlan(ws[r], bounds, shard, n)
        sources[r] = fused._fused_partials(a[r], b[r], ws[r], plan, KNOBS)
        # the hook routes only: READY (below) tells the owners, no per-chunk words are published
        assert any("without signals" in why for why in last_plan().reasons), last_plan().reasons
        ws[r].signal(plan.ready_out)
    for r in range(world_size):
        peers = [(r + i) % world_size for i in range(1, world_size)]
        ws[r].wait(ws[r].incoming("READY", peers), symm.WAIT_READY)
        assert ws[r].error[0].item() == 0, "a peer's READY was not raised"
        out = torch.full((shard, n), float("nan"), dtype=dtype)
        ws[r].reduce(("rs", shard, n), sources[r], out)
        lo, hi = bounds[r]
        for src in range(world_size):   # every source's rows of this owner landed in its slot
            testing.assert_close(sources[r][src], testing.Reference.of(a[src][lo:hi], b[src]), dtype=dtype,
                                 what=f"inbox of owner {r} from rank {src}")
        want = sum(a[src][lo:hi].double() @ b[src].double() for src in range(world_size))
        assert torch.isfinite(out).all()
        assert (out.double() - want).abs().max() <= 0.05 * want.abs().max()


def test_fused_ag_gemm_round_order_waits_on_arrival_words():
    """The wait hook as fused.ag_gemm calls it: round order from this rank's chunk, one chunk per
    rank (37 rows: tiles straddle two chunks), arrival words at 1 -- and a missing one times out."""
    world_size, m_shard, k, n, rank = 3, 37, 24, 40, 1
    g = torch.Generator().manual_seed(3)
    a_full = torch.randn(world_size * m_shard, k, generator=g).to(torch.float16)
    b = torch.randn(n, k, generator=g).to(torch.float16).t()
    arrived = torch.ones(world_size, dtype=torch.int32)
    out = torch.full((world_size * m_shard, n), float("nan"), dtype=torch.float16)
    error = torch.zeros(symm.ERROR_WORDS, dtype=torch.int32)
    matmul(a_full, b, out=out, config=CFG, tile_order="round", start_chunk=rank,
           wait=WaitSpec(signal=arrived, generation=1, chunk_m=m_shard, max_spins=50, error=error, rank=rank),
           num_sms=2)
    assert error[0].item() == 0
    testing.assert_close(out, testing.Reference.of(a_full, b), dtype=torch.float16, what="fused ag_gemm's GEMM")
    arrived[2] = 0   # chunk 2 never arrives
    with pytest.raises(TimeoutError, match=r"chunk=2"):
        matmul(a_full, b, out=out, config=CFG, tile_order="round", start_chunk=rank,
               wait=WaitSpec(signal=arrived, generation=1, chunk_m=m_shard, max_spins=50, rank=rank), num_sms=2)


def test_fused_refuses_float32_and_the_sm_budget_knob_is_checked():
    class Ctx:
        backend, world_size = "gloo", 2

    assert "TF32" in fused.why_unavailable(Ctx, torch.device("cuda", 0), torch.float32)
    with pytest.raises(ValueError, match="num_sms"):
        fused.FusedKnobs(num_sms=0)
    with pytest.raises(TypeError, match="FusedKnobs"):
        fused.sm_budget(torch.device("cpu"), 2, {"num_sms": 4})
    assert not hasattr(fused, "set_options")   # knobs are per call, never process-wide
    assert row_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("world_size, m_shard, pieces", [(2, 37, 1), (2, 37, 3), (4, 37, 4), (3, 16, 2), (4, 10, 10)])
def test_fused_ag_pieces_cover_every_row_once_and_set_each_arrival_word_after_its_last_copy(world_size, m_shard,
                                                                                            pieces):
    """More chunks than ranks: fused.ag_gemm's copies cut at chunk boundaries (a chunk may
    straddle two shards, e.g. 37 rows in 3 chunks of 13): every row is copied exactly once, from
    its own shard, local shard first then rank+1, rank+2, ...; each chunk's word is set once,
    after the last copy that touches it."""
    chunk_m = -(-m_shard // pieces)
    m = world_size * m_shard
    for rank in range(world_size):
        got = fused._ag_pieces(rank, world_size, m_shard, chunk_m)
        covered = torch.zeros(m, dtype=torch.int32)
        order = [(rank + i) % world_size for i in range(world_size)]
        assert [p[0] for p in got] == sorted((p[0] for p in got), key=order.index)   # issue order
        for src, lo, hi, chunk, _ in got:
            assert src * m_shard <= lo < hi <= (src + 1) * m_shard
            assert chunk * chunk_m <= lo and hi <= (chunk + 1) * chunk_m
            covered[lo:hi] += 1
        assert covered.eq(1).all()
        lasts = [p[3] for p in got if p[4]]
        assert sorted(lasts) == list(range(-(-m // chunk_m)))                   # one per chunk
        for i, (_, _, _, chunk, last) in enumerate(got):
            later = any(p[3] == chunk for p in got[i + 1:])
            assert last == (not later)
    if pieces == 1 and m_shard % chunk_m == 0:
        assert [p[:4] for p in fused._ag_pieces(1, world_size, m_shard, chunk_m)] == [
            (r, r * m_shard, (r + 1) * m_shard, r) for r in [(1 + i) % world_size for i in range(world_size)]]


def test_fused_ag_gemm_waits_per_piece_with_more_chunks_than_ranks():
    """The wait hook as fused.ag_gemm calls it with 3 pieces per rank (chunks of 13 rows over
    shards of 37: chunks straddle shards and tiles straddle chunks): every word set -> the
    product; the word of one chunk missing -> TimeoutError naming that chunk."""
    world_size, m_shard, k, n, rank, pieces = 3, 37, 24, 40, 1, 3
    chunk_m = -(-m_shard // pieces)
    m = world_size * m_shard
    num_chunks = -(-m // chunk_m)
    g = torch.Generator().manual_seed(5)
    a_full = torch.randn(m, k, generator=g).to(torch.float16)
    b = torch.randn(n, k, generator=g).to(torch.float16).t()
    arrived = torch.zeros(num_chunks, dtype=torch.int32)
    for _, _, _, chunk, last in fused._ag_pieces(rank, world_size, m_shard, chunk_m):
        if last:
            arrived[chunk] = 1
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    start = rank * m_shard // chunk_m
    matmul(a_full, b, out=out, config=CFG, tile_order="round", start_chunk=start,
           wait=WaitSpec(signal=arrived, generation=1, chunk_m=chunk_m, max_spins=50, rank=rank), num_sms=2)
    testing.assert_close(out, testing.Reference.of(a_full, b), dtype=torch.float16, what="fused ag_gemm, 3 pieces")
    arrived[5] = 0
    with pytest.raises(TimeoutError, match=r"chunk=5"):
        matmul(a_full, b, out=out, config=CFG, tile_order="round", start_chunk=start,
               wait=WaitSpec(signal=arrived, generation=1, chunk_m=chunk_m, max_spins=50, rank=rank), num_sms=2)


def test_fused_options_chunks_per_rank_is_checked_and_pinned():
    with pytest.raises(ValueError, match="chunks_per_rank"):
        fused.FusedKnobs(chunks_per_rank=0)
    with pytest.raises(ValueError, match="chunks_per_rank"):
        fused.FusedKnobs(chunks_per_rank=True)
    # unpinned: the planner's knob for this shape (what tpfuse.plan reports)
    from tpfuse.model.hardware import detect
    fused_ag_chunks_per_rank = fused.planned_chunks_per_rank
    for m_shard in (37, 4096, 16384):
        want = fused_ag_chunks_per_rank(m_shard, 1536, 8192, 8, torch.float16, detect(torch.device("cpu")))
        assert fused.chunks_per_rank(m_shard, 1536, 8192, 8, torch.float16, torch.device("cpu")) == want
    pinned = fused.FusedKnobs(num_sms=2, chunks_per_rank=4)
    assert fused.chunks_per_rank(37, 8, 8, 2, torch.float16, torch.device("cpu"), pinned) == 4
    assert fused.chunks_per_rank(3, 8, 8, 2, torch.float16, torch.device("cpu"), pinned) == 3   # at most one row each
