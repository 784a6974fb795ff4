"""``fused``: one persistent GEMM launch per op, hooked to the communication chunk by chunk.

* ``ag_gemm`` (consumer-side fusion, FLUX style): the copy engine fills the gathered buffer as in
  ``copy_engine`` (side stream: ``copy_``, then the chunk's *arrival* word = 1 by
  ``stream_write_value32``, a stream memory operation), while ONE persistent GEMM
  (``tpfuse.gemm.matmul`` with a wait hook, tile order "round" from this rank's chunk) starts
  on the local chunk and waits per tile only for the chunks its A rows touch.  SMs move only
  this rank's own shard: the publish launch (``_symm_steps.publish_shard``: credit wait, the
  shard into this rank's slot and a_full's own rows, the own chunks' arrival words, READY out,
  then the wait for every peer's READY, which the side stream's pulls follow; one launch
  instead of six operations and a flag wait per peer).  The call's last launch (the NaN fill)
  returns the DONE credits.  Each shard may be cut into several pieces
  (``FusedKnobs.chunks_per_rank``, else the planner's choice per shape): a chunk may then
  straddle two shards, and its word is set after the last copy touching it.
* ``gemm_rs`` (producer-side fusion): ONE persistent GEMM in owner order ((rank + 1) first)
  whose epilogue stores every finished tile straight into its owner's inbox slot (peer
  memory); after the launch this rank raises READY on every owner (the generation from
  device memory); the owner reduces its W inbox slots in float32 in rank order (the
  ``copy_engine`` reduce) after its READY flags.
* ``gemm_ar``: the fused ``gemm_rs`` schedule over equal row chunks, the owner's reduce into its
  gather slot and its own rows (``copy_engine``'s two-shot path), then ONE launch gathers the
  other owners' reduced chunks (``_symm_steps.gather_reduced`` with ``one_launch``;
  ``symm.Workspace.gather``): each peer's READY2 wait and SM pull in turn, then DONE2 to every
  peer, or NaN over the whole output when broken -- where ``copy_engine`` issues a wait and a
  copy-engine ``copy_`` per peer and a NaN fill.  Outputs up to 1 MiB take ``copy_engine``'s
  one-shot path (every rank reads all partials in place and sums them in float32 in rank
  order), and an M that W does not divide its two-shot path.

The arrival words are this rank's own (one producer, one consumer, in stream order): they
hold 1 while a call runs and are reset to 0 on the compute stream after the GEMM (by the call's
last launch, the NaN fill), before the next call's side stream can touch them.  So the wait
hook's generation is the constant 1, which a CUDA graph may replay; cross-rank flags keep the
workspace's device-memory generations.  The epilogue hook runs without signals (it routes the
rows only): READY, raised once after the launch, is what tells an owner its rows landed, so
per-chunk words would be read by nobody, and their counts and publication cost the GEMM (~4 %
of a 49 us fp8 call on the H200).  DESIGN.md §2 has the RS epilogue signal per chunk; a
per-chunk relay of those signals was tried and not kept (docs/ops.md).

fp8 (``scale_a``, ``scale_b``, ``out_dtype`` given; e4m3, or e5m2 with e4m3): the same launches
with fp8 operands, the scales applied in the GEMM's epilogue (``tpfuse.gemm.matmul``'s
``scale_a``/``scale_b``/``out_dtype``; ``b`` column-major, as the fp8 MMAs read it: another
layout is copied once).  ``ag_gemm``: a row-wise ``scale_a`` travels in each rank's slot after its
rows and is pulled with them, piece by piece, before the piece's arrival word is set, so every
tile's epilogue reads the scales of rows that have landed (the scales are indexed by global
row, like the gathered A).  ``gemm_rs``/``gemm_ar``: the epilogue stores float32 partials (the
policy's reduce dtype) into the owners' float32 inboxes; the owner sums them in float32 and the
result is rounded once to ``out_dtype``.

No call waits for the GPU: a timed-out wait (a flag's or the GEMM's hook, which shares the
workspace's error word) breaks the workspace, the outputs of that call and of every later one
are NaN, and the next call on the group raises ``TimeoutError`` (tpfuse/symm.py).

The GEMM's grid obeys an SM budget (:func:`sm_budget`): on one GPU shared by W processes (the
bed) the same-device copies the kernels wait for run on SMs, so the W persistent grids together
must leave SMs free.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tpfuse import _driver, dtypes, symm, timeline
from tpfuse._dist import GroupContext, breadcrumb, new_output
from tpfuse.model import cost as model_cost
from tpfuse.model import steps as model_steps
from tpfuse.model.hardware import HardwareProfile, get_profile
from tpfuse.model.simulate import Schedule, simulate
from tpfuse.strategies import copy_engine
from tpfuse.strategies import _symm_steps as steps

__all__ = ["NAME", "DESCRIPTION", "ORDER", "DTYPES", "SYMMETRIC_MEMORY", "KNOBS", "SCHEDULE", "why_unavailable",
           "ag_gemm", "gemm_rs", "gemm_ar", "FusedKnobs", "sm_budget", "chunks_per_rank", "model_sm_budget",
           "planned_chunks_per_rank", "piece_candidates", "TILE_M"]

NAME = "fused"
DESCRIPTION = ("copy-engine pulls waited on per chunk by one persistent GEMM (AG); one GEMM whose epilogue "
               "stores partials into their owners' buffers (RS, AR)")
ORDER = 30
# the Triton GEMM core multiplies float32 in TF32: fused refuses float32 (why_unavailable)
DTYPES = (dtypes.HALF, dtypes.FP8)   # fp8: scales in the persistent GEMM's epilogue
SYMMETRIC_MEMORY = True

# Rows of the fused GEMM's CTA tile: BLOCK_M of 28 of the 30 tuned configs in
# benchmarks/results/gemm_core_h200_2026-12-01_run21.json (rows[].config.BLOCK_M; 64 for the two 8B decode shapes).
# A tile waits for every piece its rows touch, so pieces shorter than this split tiles for nothing.
TILE_M = 128
PIECES_PER_RANK = (1, 2, 4)
# More pieces only when predicted at least this much faster: every piece costs a copy, an
# arrival word and their host calls, which the model only estimates (leads, no measurement).
MIN_PIECE_GAIN = 0.01

# seconds the GEMM's per-chunk waits outlast TPFUSE_TIMEOUT_S (see _AgPlan: the flag waits report first)
GEMM_WAIT_SLACK_S = 1.0


@dataclass(frozen=True)
class FusedKnobs:
    """Knobs of the fused strategy (the CTA tile comes from the GEMM core's tuning); pass them
    to the strategy's functions (``knobs=``), None: chosen per shape as the planner predicts.

    ``num_sms``: programs of the persistent GEMM (None: :func:`sm_budget`).
    ``chunks_per_rank``: ``ag_gemm`` cuts every rank's shard into this many communication
    chunks (copies, each with its arrival word; tiles wait per chunk), so the GEMM can start on
    the first rows of a peer's shard before the rest has landed (None: :func:`chunks_per_rank`).
    """

    num_sms: int | None = None
    chunks_per_rank: int | None = None

    def __post_init__(self):
        for name in ("num_sms", "chunks_per_rank"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"FusedKnobs.{name}={value!r}: must be a positive int or None")


KNOBS = FusedKnobs
_NO_KNOBS = FusedKnobs()   # what knobs=None means (one object: built and hashed on every call otherwise)


def _check_knobs(knobs) -> FusedKnobs:
    if knobs is None:
        return _NO_KNOBS
    if not isinstance(knobs, FusedKnobs):
        raise TypeError(f"knobs: expected a tpfuse.strategies.fused.FusedKnobs, got {type(knobs).__name__}")
    return knobs


def model_sm_budget(hw: HardwareProfile | int, world_size: int, *, shared_gpu: bool = False) -> int:
    """Programs of the fused persistent GEMM on ``hw`` (a profile or an SM count): every SM but
    one, which the side stream's flag kernels need while the GEMM's tiles spin on the chunks
    those kernels let through, except when the group's processes share one GPU
    (``shared_gpu``: the bed, ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``): then
    ``SMs // (W + 1)`` each, at least 1, so that W spinning grids leave SMs for the same-device
    copies they wait for (H200, W = 4: 24-32 programs each worked, the full grid timed out)."""
    sms = hw if isinstance(hw, int) else hw.sm_count
    if shared_gpu and world_size > 1:
        return max(1, sms // (world_size + 1))
    return max(1, sms - 1) if world_size > 1 else sms


def sm_budget(device: torch.device, world_size: int, knobs: FusedKnobs | None = None) -> int:
    """Programs of the fused GEMM on ``device``: ``knobs.num_sms`` if pinned, else
    :func:`model_sm_budget` of the device's SM count (which the planner models)."""
    knobs = _check_knobs(knobs)
    if knobs.num_sms is not None:
        return knobs.num_sms
    return _device_sm_budget(device, world_size)


@functools.lru_cache(maxsize=64)
def _device_sm_budget(device: torch.device, world_size: int) -> int:
    """:func:`model_sm_budget` of ``device`` (its SM count and the process's shared-GPU setting,
    read once: both sit on every call)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return model_sm_budget(sms, world_size, shared_gpu=symm.shared_gpu())


def piece_candidates(m_shard: int) -> tuple[int, ...]:
    """Pieces per rank worth simulating for a shard of ``m_shard`` rows: those of
    :data:`PIECES_PER_RANK` that cut it into equal pieces of at least :data:`TILE_M` rows (1 always)."""
    return tuple(c for c in PIECES_PER_RANK
                 if c == 1 or (m_shard % c == 0 and m_shard // c >= TILE_M))


@functools.lru_cache(maxsize=8192)
def planned_chunks_per_rank(m_shard: int, n: int, k: int, world_size: int, dtype, hw: HardwareProfile | str, *,
                            cuda_graph: bool = False, num_sms: int | None = None) -> int:
    """Pieces per rank (c) for fused ``ag_gemm`` of ``a_shard [m_shard, k] @ b [k, n]`` on
    ``world_size`` ranks: the ``c`` of :func:`piece_candidates` whose simulated fused ag_gemm
    (:data:`SCHEDULE`, one chunk of ``m_shard / c`` rows per arrival word) is fastest, more
    pieces only when at least :data:`MIN_PIECE_GAIN` faster; 1 for W = 1 or empty inputs.

    ``dtype``: torch dtype or name; ``hw``: profile or name; ``cuda_graph``: the call replays
    from a CUDA graph (no host time); ``num_sms``: the GEMM's grid (None: :func:`model_sm_budget`).
    Pure and cached (``planned_chunks_per_rank.cache_clear()``): every rank of a group computes
    the same value from the same arguments."""
    if world_size <= 1 or m_shard <= 0 or n <= 0 or k <= 0:
        return 1
    hw = get_profile(hw)
    name = dtypes.name(dtype)
    best_c, best_ms = 1, None
    for c in piece_candidates(m_shard):
        ms = simulate("ag_gemm", SCHEDULE, m=m_shard * world_size, n=n, k=k, world_size=world_size,
                      dtype=name, hw=hw, num_chunks=world_size * c, num_sms=num_sms,
                      cuda_graph=cuda_graph, fast=True, name=NAME).makespan_ms
        if best_ms is None or ms < best_ms * (1.0 - MIN_PIECE_GAIN):
            best_c, best_ms = c, ms
    return best_c


def why_unavailable(ctx: GroupContext, device: torch.device, dtype: torch.dtype) -> str | None:
    reason = copy_engine.why_unavailable(ctx, device, dtype)
    if reason is not None:
        return reason.replace("copy_engine", "fused").replace(dtypes.describe(copy_engine.DTYPES),
                                                              dtypes.describe(DTYPES))
    if not dtypes.accepts(DTYPES, dtype):
        # the Triton GEMM core multiplies fp32 inputs in TF32 (~1e-3 relative error on the H200
        # bed against 5e-6 for cuBLAS fp32); not what a float32 caller asked for
        return (f"fused runs {dtypes.describe(DTYPES)} only: its Triton GEMM multiplies float32 in TF32; "
                f"{dtypes.name(dtype)} runs with 'copy_engine' (cuBLAS, full fp32)")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "fused needs triton (pip install triton)"
    return None


def _local_words(ws: symm.Workspace, name: str, count: int) -> torch.Tensor:
    """This rank's int32 words ``name`` (zeros, reset after every call), cached on the workspace."""
    key = ("words", name, count)
    words = ws.state.get(key)
    if words is None:
        words = torch.zeros(count, dtype=torch.int32, device=ws.spec.device)
        ws.state[key] = words
    return words


def _set_word(words: _driver.Words, index: int, stream: torch.cuda.Stream) -> None:
    """``words[index] = 1`` on ``stream`` as a stream memory operation (no SM)."""
    words.set(index, stream)


def chunks_per_rank(m_shard: int, n: int, k: int, world_size: int, dtype: torch.dtype,
                    device: torch.device, knobs: FusedKnobs | None = None) -> int:
    """Pieces each rank's shard is cut into for ``ag_gemm`` (the communication chunk is
    ``ceil(m_shard / pieces)`` rows): ``knobs.chunks_per_rank`` if pinned, else the planner's
    choice for this shape and GPU (:func:`planned_chunks_per_rank`: 1, 2 or 4, by simulating
    this schedule; cached per shape), which ``tpfuse.plan`` reports."""
    knobs = _check_knobs(knobs)
    if knobs.chunks_per_rank is not None:
        return max(1, min(knobs.chunks_per_rank, m_shard))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = (m_shard, n, k, world_size, dtype, device, knobs, capturing)
    pieces = _PLANNED.get(key)
    if pieces is None:   # per shape once: the planner's arguments cost more to hash than this lookup
        from tpfuse.model.hardware import detect

        pieces = planned_chunks_per_rank(m_shard, n, k, world_size, dtype, detect(device), cuda_graph=capturing,
                                         num_sms=sm_budget(device, world_size, knobs) if device.type == "cuda" else None)
        if len(_PLANNED) >= 4096:
            _PLANNED.clear()
        _PLANNED[key] = pieces
    return pieces


_PLANNED: dict = {}   # chunks_per_rank's answers (planned_chunks_per_rank.cache_clear() does not reach them)


def _ag_pieces(rank: int, world_size: int, m_shard: int, chunk_m: int) -> list[tuple[int, int, int, int, bool]]:
    """The copies of ag_gemm in issue order -- this rank's shard, then peers rank+1, rank+2, ...
    -- cut at chunk boundaries: ``(src, lo, hi, chunk, last)`` for global rows ``[lo, hi)`` of
    ``src``'s shard lying in chunk ``chunk`` (rows ``[chunk*chunk_m, (chunk+1)*chunk_m)`` of the
    gathered A); ``last``: no later piece touches that chunk, so its arrival word may be set
    after this copy.  A chunk may straddle two ranks' shards."""
    order = [(rank + i) % world_size for i in range(world_size)]
    pieces = []
    for src in order:
        lo, hi = src * m_shard, (src + 1) * m_shard
        for chunk in range(lo // chunk_m, (hi - 1) // chunk_m + 1):
            pieces.append([src, max(lo, chunk * chunk_m), min(hi, (chunk + 1) * chunk_m), chunk, True])
    seen = set()
    for piece in reversed(pieces):
        piece[4] = piece[3] not in seen
        seen.add(piece[3])
    return [tuple(p) for p in pieces]


def _gemm(name: str, chunk_m: int, a: torch.Tensor, b: torch.Tensor, prepared: dict | None = None,
          **kwargs) -> None:
    """``tpfuse.gemm.matmul(a, b, **kwargs)``; while a timeline records (not under capture),
    also its span and its per-tile records (``tile_records``).  ``prepared``: the calling plan's
    :class:`tpfuse.gemm.PreparedMatmul` per (SM budget, output dtype), the rest of ``kwargs``
    but ``out`` and the scales being the plan's own on every call."""
    from tpfuse.gemm import last_plan, matmul
    from tpfuse.kernels.abi import TILE_RECORD_COLUMNS

    rec = timeline.current()
    if rec is None or torch.cuda.is_current_stream_capturing():
        if prepared is None:
            matmul(a, b, **kwargs)
            return
        out, scale_a, scale_b = kwargs.pop("out", None), kwargs.pop("scale_a", None), kwargs.pop("scale_b", None)
        call = prepared.get((kwargs.get("num_sms"), kwargs.get("out_dtype"))) or _keep_gemm(prepared, **kwargs)
        call(a, b, out=out, scale_a=scale_a, scale_b=scale_b)
        return
    tiles = -(-a.shape[0] // 64) * -(-b.shape[1] // 64)   # enough rows for the smallest tile (64x64)
    records = torch.full((tiles, TILE_RECORD_COLUMNS), -1, dtype=torch.int64, device=a.device)
    start = rec.now(a.device)
    matmul(a, b, tile_records=records, **kwargs)
    rec.add_span("gemm", name, start, rec.now(a.device))
    rec.add_tile_records(records, last_plan(), chunk_m, start)


def _keep_gemm(prepared: dict, **fixed):
    """A new :class:`tpfuse.gemm.PreparedMatmul` of ``fixed`` (every keyword of
    :func:`tpfuse.gemm.matmul` but the per-call ``out`` and scales), kept in a plan's ``prepared``
    under the key the calls look it up by: (SM budget, output dtype)."""
    from tpfuse.gemm import PreparedMatmul

    call = prepared[(fixed.get("num_sms"), fixed.get("out_dtype"))] = PreparedMatmul(**fixed)
    return call


class _AgPlan:
    """What a fused ag_gemm call of one shape needs, built once per workspace and shape: the
    copies in issue order with their peers' slots, READY tables and arrival words, the flag
    tables of the call, and the GEMM's wait spec (the workspace's error word: a broken workspace
    stops the GEMM's waits too)."""

    def __init__(self, ws: symm.Workspace, m_shard: int, k: int, chunk_m: int, arrived: torch.Tensor,
                 rowwise: bool = False):
        from tpfuse.gemm import WaitSpec

        rank, world_size = ws.rank, ws.world_size
        self.peers = steps.peers(rank, world_size)
        self.credits = ws.incoming("DONE", self.peers)
        self.ready_out = ws.outgoing("READY", self.peers)
        self.done_out = ws.outgoing("DONE", self.peers)
        self.mine = slice(rank * m_shard, (rank + 1) * m_shard)
        pieces = _ag_pieces(rank, world_size, m_shard, chunk_m)
        self.own_words = [chunk for src, _, _, chunk, last in pieces if src == rank and last]
        # their addresses, for the publish launch that sets them (after the own rows' copy)
        self.own_word_table = ws.pointer_table(("fused own words", id(arrived), tuple(self.own_words)),
                                               [arrived[i] for i in self.own_words]) if self.own_words else None
        # every peer's READY, waited for at the end of the publish launch
        self.ready_in = ws.incoming("READY", self.peers)
        # (src, lo, hi, chunk, peer rows, peer scale rows (fp8 row-wise) or None, last, span label)
        self.pulls = []
        for src, lo, hi, chunk, last in pieces:
            if src == rank:
                continue
            base = src * m_shard
            scale_rows = steps.ag_scale_slot(ws, src, m_shard, k)[lo - base:hi - base] if rowwise else None
            self.pulls.append((src, lo, hi, chunk, ws.data(src, (m_shard, k))[lo - base:hi - base],
                               scale_rows, last, f"pull {src} rows {lo}:{hi}"))
        # The tiles wait a little longer than TPFUSE_TIMEOUT_S: a dead peer is reported by the
        # publish launch's READY wait, which names it (the GEMM's wait only knows a chunk: when
        # the flag waits ran beside the GEMM, its wait for chunk 0 won the record on the H200
        # bed at W = 4 and named rank 0, not the dead rank 3). A recorded error ends the tiles'
        # waits at once anyway.
        bound_s = symm.timeout_s() + GEMM_WAIT_SLACK_S
        self.wait = WaitSpec(signal=arrived, generation=1, chunk_m=chunk_m, timeout_ns=int(bound_s * 1e9),
                             max_spins=max(1, int(bound_s * 1000)), error=ws.error, rank=rank)
        self.start_chunk = rank * m_shard // chunk_m
        self.chunk_owner = lambda chunk: min(chunk * chunk_m // m_shard, world_size - 1)   # first rows' owner
        self.fork, self.joined = torch.cuda.Event(), torch.cuda.Event()   # side waits for compute, and back
        self.gemms: dict = {}   # the GEMM's PreparedMatmul per (SM budget, output dtype)
        # the pulls into a_full's rows and the arrival words, checked once (a driver call each)
        self.copies = _driver.RowCopies([(lo, hi, rows) for _, lo, hi, _, rows, _, _, _ in self.pulls],
                                        into=True, row_shape=(k,), dtype=ws.spec.dtype)
        self.words = _driver.Words(arrived)
        # the lean path's launches (no row-wise scales, no timeline): the publish (credits, the
        # shard into its slot and a_full's own rows, the own arrival words, READY out, the
        # peers' READY in) and, per (c's shape, c's dtype), the NaN fill with the words' reset and DONE
        self.publish = ws.publisher(self.credits, self.ready_out, ws.data(rank, (m_shard, k)),
                                    (self.mine.start, self.mine.stop), wait_in=self.ready_in,
                                    local=self.own_word_table)
        self.last_words = [chunk if last else None for _, _, _, chunk, _, _, last, _ in self.pulls]
        self.arrived = arrived
        self.finish: dict = {}


def _ag_lean(a_shard: torch.Tensor, b: torch.Tensor, ws: symm.Workspace, plan: _AgPlan, a_full: torch.Tensor,
             c: torch.Tensor, main: torch.cuda.Stream, side: torch.cuda.Stream, num_sms: int,
             out_dtype: torch.dtype | None, scales: dict) -> None:
    """:func:`ag_gemm` where nothing records a timeline and no row-wise scales travel (every eager
    call but those): the same operations in the same order, the publish and the NaN fill through
    the plan's prepared launches, the GEMM through its PreparedMatmul, no spans (issue 34)."""
    plan.publish(a_shard, a_full)
    steps.join(side, main, plan.fork)
    copies, base = plan.copies, plan.copies.bind(a_full)
    for i, chunk in enumerate(plan.last_words):
        copies.copy(i, a_full, base, side)
        if chunk is not None:
            _set_word(plan.words, chunk, side)
    # the GEMM _gemm would launch (its kwargs and key), kept in the plan as _gemm keeps it
    gemm = plan.gemms.get((num_sms, out_dtype)) or _keep_gemm(
        plan.gemms, tile_order="round", start_chunk=plan.start_chunk, wait=plan.wait, check=False, num_sms=num_sms,
        **({} if out_dtype is None else {"out_dtype": out_dtype}))
    gemm(a_full, b, out=c, **scales)
    steps.join(main, side, plan.joined)
    steps.lean_finish(ws, plan.finish, c, a_full, signal=plan.done_out, zero=plan.arrived)


def _column_major(b: torch.Tensor) -> torch.Tensor:
    """``b`` as the fp8 MMAs read it: column-major (``weight.t()`` already is; else one copy)."""
    return b if b.stride(0) == 1 or b.shape[0] <= 1 else b.t().contiguous().t()


def _scale_kwargs(scale_a, scale_b, out_dtype) -> dict:
    """The GEMM core's scale arguments of an fp8 call ({} otherwise): contiguous scales."""
    if scale_a is None:
        return {}
    return dict(scale_a=scale_a.contiguous(), scale_b=scale_b.contiguous(), out_dtype=out_dtype)


def ag_gemm(a_shard: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
            knobs: FusedKnobs | None = None):
    """(c, a_full), or (c, a_full, scale_a_full) when scaled (fp8)."""
    world_size, rank = ctx.world_size, ctx.rank
    m_shard, k = a_shard.shape
    n = b.shape[1]
    if world_size == 1 or m_shard * k == 0 or n == 0:
        return copy_engine.ag_gemm(a_shard, b, ctx, scale_a, scale_b, out_dtype)
    scaled = scale_a is not None
    rowwise = scaled and scale_a.dim() == 2
    m = world_size * m_shard
    dev = a_shard.device
    a_full = new_output((m, k), dtype=a_shard.dtype, device=dev)
    c = new_output((m, n), dtype=out_dtype or a_shard.dtype, device=dev)
    scale_full = None
    if scaled:
        b = _column_major(b)
        scale_full = new_output((m, 1), dtype=scale_a.dtype, device=dev) if rowwise else scale_a.clone()
    pieces_per_rank = chunks_per_rank(m_shard, n, k, world_size, a_shard.dtype, dev, knobs)
    chunk_m = -(-m_shard // pieces_per_rank)

    need = steps.ag_slot_bytes(m_shard, k, a_shard.element_size(), rowwise)
    ws = symm.get_workspace(ctx, "ag_gemm", a_shard.dtype, dev, need)
    arrived = _local_words(ws, "arrived", -(-m // chunk_m))
    plan = steps.cached(ws, ("fused ag", m_shard, k, chunk_m, rowwise),
                        lambda: _AgPlan(ws, m_shard, k, chunk_m, arrived, rowwise))
    main, side = ws.current_stream(), ws.stream
    breadcrumb("fused ag_gemm: publishing the local shard")
    ws.host.chunk_owner = plan.chunk_owner   # names the peer if the GEMM's wait times out
    if not rowwise and timeline.current() is None:
        num_sms = sm_budget(dev, world_size, knobs)
        scales = {} if not scaled else dict(scale_a=scale_full, scale_b=scale_b.contiguous())
        _ag_lean(a_shard, b, ws, plan, a_full, c, main, side, num_sms, c.dtype if scaled else None, scales)
        return (c, a_full, scale_full) if scaled else (c, a_full)
    # one launch: the slot, a_full's own rows (and scale rows), the own chunks' arrival words,
    # READY out, then the wait for every peer's READY (one wait, not one per peer: a pull starts
    # once the last peer has published; copy_engine.ag_gemm says what that costs)
    with timeline.span("wait", "publish + READY all", device=dev, chunk=plan.start_chunk):
        steps.publish_shard(ws, a_shard, plan.credits, plan.ready_out, scale_a if rowwise else None,
                            also=a_full[plan.mine], scale_also=scale_full[plan.mine] if rowwise else None,
                            words=plan.own_word_table, wait_ready=plan.ready_in)
    # The pulls are issued before the GEMM is launched: a launch first, with the side stream's
    # kernels issued after it, timed out in the bed when their first call's JIT compile outlasted
    # the GEMM's bounded spins (docs/ops.md, tried and not kept).
    steps.join(side, main, plan.fork)
    base = plan.copies.bind(a_full)
    with steps.side_for_spans(ws):   # every operation below names the side stream
        for i, (src, lo, hi, chunk, rows, scale_rows, last, label) in enumerate(plan.pulls):
            with timeline.span("copy", label, device=dev, chunk=chunk):
                plan.copies.copy(i, a_full, base, side)
                if scale_rows is not None:   # before the arrival word: the tiles' epilogues read them
                    _driver.copy_(scale_full[lo:hi], scale_rows, stream=side)
            if last:
                _set_word(plan.words, chunk, side)
    _gemm("fused GEMM (waits per chunk)", chunk_m, a_full, b, plan.gemms, out=c, tile_order="round",
          start_chunk=plan.start_chunk, wait=plan.wait, check=False, num_sms=sm_budget(dev, world_size, knobs),
          **_scale_kwargs(scale_full, scale_b, c.dtype))
    steps.join(main, side, plan.joined)
    # no record_stream of a_full / scale_full: the join above follows all of the side stream's
    # work of this call (copy_engine.ag_gemm says why that matters on the host)
    # NaN when broken (this call's wait or the GEMM's timed out, or an earlier one), and in the same
    # launch the arrival words back at 0 and (unless broken) DONE to every peer: after the GEMM
    # (main stream), which ends only once every word was set, and after the join, so after the
    # side stream's last write of a word and its last read of a peer's slot
    if not scaled:
        steps.finish(ws, c, a_full, zero=arrived, signal=plan.done_out)
        return c, a_full
    if rowwise:
        ws.poison_on_error(c, a_full, scale_full, zero=arrived, signal=plan.done_out)
    else:
        steps.finish(ws, c, a_full, zero=arrived, signal=plan.done_out)
    return c, a_full, scale_full


class _PartialsPlan:
    """gemm_rs / gemm_ar phase 1 of one shape: the epilogue spec (each owner's inbox slot for
    this rank; no signals), this rank's inbox in rank order, the tables."""

    def __init__(self, ws: symm.Workspace, bounds: list[tuple[int, int]], slot_rows: int, n: int):
        from tpfuse.gemm import EpilogueSpec

        rank, world_size = ws.rank, ws.world_size
        self.chunk_m = bounds[0][1] - bounds[0][0]
        self.peers = steps.peers(rank, world_size)
        self.credits = ws.incoming("DONE", self.peers)
        self.ready_out = ws.outgoing("READY", self.peers)
        self.ready_in = ws.incoming("READY", self.peers)
        self.done_out = ws.outgoing("DONE", self.peers)
        # the hook without signals: it routes each owner's rows into that owner's inbox and
        # publishes nothing (READY follows the launch, so nobody would read per-chunk words); no
        # count, no fence, no publication in the GEMM
        dests = [ws.data(owner, (slot_rows, n), offset=rank * slot_rows * n) for owner in range(world_size)]
        self.epilogue = EpilogueSpec.from_tensors(dests, None, generation=1, chunk_m=self.chunk_m)
        self.sources = [ws.data(rank, (slot_rows, n), offset=src * slot_rows * n)[: bounds[rank][1] - bounds[rank][0]]
                        for src in range(world_size)]
        self.start_chunk = (rank + 1) % world_size
        self.gemms: dict = {}   # the GEMM's PreparedMatmul per (SM budget, output dtype)


def _fused_partials(a: torch.Tensor, b: torch.Tensor, ws: symm.Workspace, plan: _PartialsPlan,
                    knobs: FusedKnobs | None = None, scales: dict | None = None) -> list[torch.Tensor]:
    """Phase 1 of gemm_rs/gemm_ar: ONE GEMM in owner order storing each owner's rows straight
    into that owner's inbox slot for this rank.  Returns this rank's inbox slots in rank order;
    the caller raises READY[rank] on every owner (in the launch of its next wait).

    READY is raised once after the GEMM, not per chunk: an owner's reduce needs every rank's
    chunk, and the last of those lands at the end of some rank's GEMM either way.  (A per-chunk
    relay kernel was tried: it started its bounded wait before the first call's JIT compile of
    the GEMM had finished and timed out.)  ``scales`` (fp8): the GEMM core's scale arguments,
    ``out_dtype`` the workspace's (float32 partials)."""
    _gemm("fused GEMM (epilogue to owners)", plan.chunk_m, a, b, plan.gemms, tile_order="owner",
          start_chunk=plan.start_chunk, epilogue=plan.epilogue, num_sms=sm_budget(a.device, ws.world_size, knobs),
          **(scales or {}))
    return plan.sources


def gemm_rs(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
            knobs: FusedKnobs | None = None) -> torch.Tensor:
    m, n, k = a.shape[0], b.shape[1], a.shape[1]
    world_size = ctx.world_size
    if world_size == 1 or m * n * k == 0:
        return copy_engine.gemm_rs(a, b, ctx, scale_a, scale_b, out_dtype)
    acc_dtype = copy_engine.partial_dtype(a.dtype)   # fp8: float32 partials, rounded once after the sum
    scales = None
    if scale_a is not None:
        b = _column_major(b)
        scales = _scale_kwargs(scale_a, scale_b, acc_dtype)
    shard = m // world_size
    c_shard = new_output((shard, n), dtype=acc_dtype, device=a.device)
    ws = symm.get_workspace(ctx, "gemm_rs", acc_dtype, a.device, world_size * shard * n * dtypes.itemsize(acc_dtype))
    plan = steps.cached(ws, ("fused rs", shard, n), lambda: _PartialsPlan(
        ws, [(r * shard, (r + 1) * shard) for r in range(world_size)], shard, n))
    breadcrumb("fused gemm_rs: the GEMM stores into the owners' inboxes")
    ws.begin(plan.credits)
    sources = _fused_partials(a, b, ws, plan, knobs, scales)
    # READY to every owner and the wait for every peer's READY: one launch; the reduce is the NaN fill
    # and DONE in the reduce's launch
    steps.reduce_inbox(ws, ("rs", shard, n), plan.peers, sources, c_shard, signal_first=plan.ready_out,
                       signal_after=plan.done_out, ready=plan.ready_in)
    return c_shard if scales is None else c_shard.to(out_dtype or acc_dtype)


def gemm_ar(a: torch.Tensor, b: torch.Tensor, ctx: GroupContext, scale_a: torch.Tensor | None = None,
            scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
            knobs: FusedKnobs | None = None) -> torch.Tensor:
    m, n, k = a.shape[0], b.shape[1], a.shape[1]
    world_size = ctx.world_size
    acc_dtype = copy_engine.partial_dtype(a.dtype)   # fp8: float32 partials, rounded once after the sum
    one_shot = copy_engine.ar_mode(m, n, dtypes.itemsize(acc_dtype)) == "one_shot"
    if world_size == 1 or m * n * k == 0 or m % world_size or one_shot:
        # small outputs: copy_engine's one-shot (the GEMM must finish before any rank can read
        # its partial, so there is nothing to fuse); uneven M: its two-shot path (the epilogue
        # hook needs chunks of one height)
        return copy_engine.gemm_ar(a, b, ctx, scale_a, scale_b, out_dtype)
    scales = None
    if scale_a is not None:
        b = _column_major(b)
        scales = _scale_kwargs(scale_a, scale_b, acc_dtype)
    bounds = steps.bounds_of(m, world_size)
    slot_rows = m // world_size
    ws = steps.two_shot_workspace(ctx, acc_dtype, a.device, slot_rows * n)   # copy_engine's layout and credits
    plan = steps.cached(ws, ("fused ar", m, n), lambda: _PartialsPlan(ws, bounds, slot_rows, n))
    views = steps.cached(ws, ("fused ar gathered", m, n), lambda: [
        ws.data(owner, (slot_rows, n), offset=steps.two_shot_gather_offset(ws)) for owner in range(world_size)])
    c = new_output((m, n), dtype=acc_dtype, device=a.device)

    breadcrumb("fused gemm_ar: the GEMM stores into the owners' inboxes")
    ws.begin(plan.credits)
    sources = _fused_partials(a, b, ws, plan, knobs, scales)
    # READY to every owner and the wait for the DONE2 credits: one launch; then the reduce, and the
    # READY2 waits, pulls and NaN fill or DONE2 in one more
    steps.gather_reduced(ws, plan.peers, sources, bounds, views.__getitem__, c, signal_first=plan.ready_out,
                         one_launch=True)
    return c if scales is None else c.to(out_dtype or acc_dtype)


# --- the simulator's model of this file (tpfuse.model.simulate runs it) -------------------------
def _schedule(g, c) -> None:
    if c.op == "ag_gemm":
        model_steps.pull_pieces_into_one_gemm(g, c)
    elif c.op == "gemm_rs":
        model_steps.reduce_scatter(g, c, model_steps.epilogue_store_partials, ready_first=True)
    elif copy_engine.ar_one_shot(c.m, c.n, c.elt):
        model_steps.one_shot_all_reduce(g, c)      # copy_engine's one-shot, as gemm_ar runs it
    elif c.m % c.w:   # the epilogue hook needs chunks of one height: an uneven M runs copy_engine's two-shot
        model_steps.two_shot_all_reduce(g, c, model_steps.scatter_partials, ready_first=True)
    else:
        # the gather launch's programs (symm.gather_programs, one GPU per rank: not the shared-GPU
        # cap) each load a block and store it, as sm_workers' worker CTAs do: their Little's-law
        # cost, not that of the GEMM's epilogue stores (c.xfer "sm": the GEMM's whole grid pushing)
        programs = symm.gather_programs(c.m // c.w * c.n * c.elt)

        def pull(nbytes: float) -> float:
            return model_cost.worker_transfer_time_ms(nbytes, c.hw, workers=programs,
                                                      in_flight_bytes=symm.GATHER_BLOCK_BYTES)

        model_steps.two_shot_all_reduce(g, c, model_steps.epilogue_store_partials, move=pull, ready_first=True,
                                        one_launch=True)


def _schedule_chunks(op: str, *, m: int, n: int, k: int, world_size: int, dtype: str, hw: HardwareProfile,
                     cuda_graph: bool = False, num_sms: int | None = None) -> int:
    """One chunk per rank (gemm_ar one-shot: 1); ag_gemm: W x :func:`planned_chunks_per_rank`."""
    if op == "ag_gemm":
        return world_size * planned_chunks_per_rank(-(-m // world_size), n, k, world_size, dtype, hw,
                                                    cuda_graph=cuda_graph, num_sms=num_sms)
    return 1 if op == "gemm_ar" and copy_engine.ar_one_shot(m, n, dtypes.itemsize(dtype)) else world_size


SCHEDULE = Schedule(_schedule, kind="pipeline", num_chunks=_schedule_chunks, chunk_knob_ops=("ag_gemm",),
                    sm_budget=model_sm_budget, tile_m=TILE_M)
