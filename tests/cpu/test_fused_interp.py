"""The fused strategy's index and owner arithmetic under TRITON_INTERPRET=1, on CPU tensors
standing in for W ranks' symmetric allocations (tpfuse/symm.py), signals pre-set where a peer
would raise them.  The protocol itself runs on the GPU bed (tests/gpu/bed.py)."""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")

from tpfuse import symm, testing  # noqa: E402
from tpfuse.gemm import GemmConfig, WaitSpec, matmul  # noqa: E402
from tpfuse.strategies import fused  # noqa: E402
from tpfuse.strategies.ring import _row_bounds  # noqa: E402

from _symm_interp import fake_ranks, interpreted  # noqa: E402

CFG = GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    with interpreted():
        fused.set_options(fused.FusedOptions(num_sms=2))   # 2 programs: each loops over several tiles
        yield
        fused.set_options(fused.FusedOptions())


class _Ctx:
    def __init__(self, rank, world_size):
        self.rank, self.world_size, self.group_name = rank, world_size, "fake"


@pytest.mark.parametrize("world_size, shard, n, k", [(2, 37, 24, 40), (3, 16, 33, 20)])
def test_fused_gemm_rs_routes_every_owners_rows_to_its_inbox_and_reduces_in_rank_order(world_size, shard, n, k):
    """fused._fused_partials on every rank (one owner-order GEMM whose epilogue stores into the
    owners' inbox slots, then READY to every owner), then each owner's wait and fp32 reduce:
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
        sources[r] = fused._fused_partials(a[r], b[r], _Ctx(r, world_size), ws[r], bounds, shard)
        assert fused._local_words(ws[r], "sent", world_size).sum().item() == 0   # reset after the GEMM
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
        fused.FusedOptions(num_sms=0)
    with pytest.raises(TypeError, match="FusedOptions"):
        fused.set_options({"num_sms": 4})
    assert _row_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
