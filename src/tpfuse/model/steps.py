"""The steps our strategies' simulator schedules are made of (``SCHEDULE`` in each strategy
module composes them; a new strategy may use them or add its own tasks with ``Graph.add``).

Each step adds, for every rank in ``g.ranks``, the tasks that the strategy's code issues, in its
order: host-issued launches, copies, flag kernels and stream writes are ``launch=True`` (one host
call each in eager mode); flags take no device time (their latency is in the copies' alpha).
A persistent GEMM is one launch whose M-tiles run as row bands in its tile order ("round" from
the local chunk for ag_gemm, "owner" from rank + 1 for gemm_rs); a band waits for every piece its
rows touch (ag) or sends its rows to their owners when done (rs).
"""

from __future__ import annotations

import bisect
from typing import Callable

from tpfuse import dtypes
from tpfuse.model import cost
from tpfuse.model.simulate import Ctx, Graph, row_bounds, split_rows

__all__ = ["collective_then_gemm", "ring_all_gather", "ring_reduce_scatter", "ring_all_reduce", "publish",
           "pull_then_gemm_per_chunk", "pull_pieces_into_one_gemm", "scatter_partials",
           "epilogue_store_partials", "reduce_owned", "reduce_scatter", "one_shot_all_reduce",
           "two_shot_all_reduce", "staged_partials"]

# (graph, ctx, row bounds of the owners) -> rank -> the tasks its reduce waits for
Partials = Callable[[Graph, Ctx, list], dict]
# bytes of one chunk -> ms to move it (a strategy's own transport, e.g. sm_workers' worker CTAs)
Move = Callable[[float], float]


def _bands(bounds: list[tuple[int, int]], start_row: int, tile_m: int) -> list[tuple[int, int, int, int]]:
    """The persistent GEMM's M-tiles (``tile_m`` rows each) in its tile order -- the M-tile
    holding ``start_row`` first, then on round in row order (``tpfuse/kernels/gemm.py``: "round"
    and "owner") -- as bands ``(lo, hi, first, last)``: consecutive M-tiles whose rows touch the
    same chunks ``bounds[first..last]`` are one band (a tile touching two chunks waits for both,
    or, in owner order, runs with the earlier one)."""
    total = bounds[-1][1]
    if total <= 0:
        return [(0, 0, 0, len(bounds) - 1)]
    starts = [lo for lo, _ in bounds]
    num = -(-total // tile_m)
    t0 = (start_row // tile_m) % num
    out: list[tuple[int, int, int, int]] = []
    # Tiles t0..num-1, then 0..t0-1; a run of tiles inside one chunk is taken in one step, so the
    # work is O(chunks), not O(M / tile_m) (a plan must stay fast at any M).
    for b, end in ((t0, num), (0, t0)):
        while b < end:
            lo, hi = b * tile_m, min((b + 1) * tile_m, total)
            first, last = bisect.bisect_right(starts, lo) - 1, bisect.bisect_right(starts, hi - 1) - 1
            step = 1
            if first == last:  # every later tile that ends inside this chunk joins the run
                chunk_end = bounds[first][1]
                step = max(1, min(end, num if chunk_end >= total else chunk_end // tile_m) - b)
                hi = min((b + step) * tile_m, total)
            if out and out[-1][1] == lo and out[-1][2:] == (first, last):
                out[-1] = (out[-1][0], hi, first, last)
            else:
                out.append((lo, hi, first, last))
            b += step
    return out


# A band's epilogue stores are modelled in up to this many parts, each sent when its tiles are
# done, so that the stores of a band trail its compute (they overlap the later tiles' compute).
_STORE_PARTS = 4
def collective_then_gemm(g: Graph, c: Ctx) -> None:
    """unfused: collective then GEMM (ag), or GEMM then upcast of the partial to
    the accumulation dtype, collective on it, downcast (rs, ar); NCCL waits for every rank."""
    full = cost.gemm_time_ms(c.m, c.n, c.k, c.dtype, c.hw)
    up, comm, down = cost.unfused_collective_parts(c.op, c.m, c.n, c.k, c.w, c.dtype, c.hw)
    if c.op == "ag_gemm":
        # NCCL waits for every rank: each all-gather depends on every rank having issued its own
        issued = {r: g.add(r, "comm", "comm", 0.0, label="join", launch=True) for r in g.ranks}
        for r in g.ranks:
            t = g.add(r, "comm", "comm", comm, deps=tuple(issued.values()), label="all_gather")
            gt = g.add(r, "gemm", "gemm", full, deps=(t,), label="GEMM", launch=True)
            g.pairs.append((r, t, gt))
    else:
        gemms = {r: g.add(r, "gemm", "gemm", full, label="GEMM", launch=True) for r in g.ranks}
        ups = {r: g.add(r, "gemm", "reduce", up, deps=(gemms[r],), label="upcast", launch=True) for r in g.ranks}
        name = "reduce_scatter" if c.op == "gemm_rs" else "all_reduce"
        for r in g.ranks:
            t = g.add(r, "comm", "comm", comm, deps=tuple(ups.values()), label=name, launch=True)
            g.add(r, "gemm", "reduce", down, deps=(t,), label="downcast", launch=True)
            g.pairs.append((r, gemms[r], t))


def ring_all_gather(g: Graph, c: Ctx) -> None:
    """ring ag_gemm (strategies/ring.py): W steps; the host issues each step (host time only)."""
    w = c.w
    shard_rows = c.shard_rows()
    # step s: compute on shard (r - s) while shard (r - s - 1) travels from rank r - 1
    # (posted by the host when it issued step s - 1).
    contended = c.hw.sm_count - c.hw.nccl_sms
    for r in g.ranks:
        c.host_steps(g, r, w)
    recv = {}  # (rank, step) -> tid
    for s in range(1, w):
        for r in g.ranks:
            src = (r - s) % w
            prev = recv.get((g.peer((r - 1) % w), s - 1))
            recv[(r, s)] = g.add(r, "comm", "comm", c.xfer(shard_rows[src] * c.k * c.elt, "p2p"),
                                 deps=(prev,), label=f"recv {src}", chunk=src)
    for r in g.ranks:
        for s in range(w):
            src = (r - s) % w
            dep = recv.get((r, s))
            sms = contended if s < w - 1 else None
            t = g.add(r, "gemm", "gemm", c.gemm(shard_rows[src], num_sms=sms), deps=(dep,),
                      label=f"GEMM {src}", chunk=src)
            if dep is not None:
                g.pairs.append((r, dep, t))


def ring_reduce_scatter(g: Graph, c: Ctx) -> dict[int, int]:
    """tpfuse's ring reduce-scatter (strategies/ring.py): step s GEMMs the partial of shard
    r - s - 1, upcasts it to the accumulation dtype, adds what rank r - 1 sent at step s - 1 and
    sends the sum on (4-byte partials on the wire for bf16); the last step's shard is r's own,
    downcast at the end.  The next step's GEMM is issued after the add (one compute stream).
    Returns rank -> the tid of its downcast."""
    w = c.w
    shard_rows = c.shard_rows()
    acc = cost.accumulation_dtype(c.dtype)
    acc_elt = dtypes.itemsize(acc)
    contended = c.hw.sm_count - c.hw.nccl_sms
    send: dict[tuple[int, int], int] = {}
    finals: dict[int, int] = {}
    for r in g.ranks:
        c.host_steps(g, r, w)
    for s in range(w):
        for r in g.ranks:
            dst = (r - s - 1) % w
            rows = shard_rows[dst]
            sms = contended if s < w - 1 else None
            gt = g.add(r, "gemm", "gemm", c.gemm(rows, num_sms=sms), 
                       label=f"GEMM {dst}", chunk=dst)
            ready = g.add(r, "gemm", "reduce", cost.cast_time_ms(rows * c.n, c.dtype, acc, c.hw),
                          deps=(gt,), label=f"upcast {dst}", chunk=dst)
            if s > 0:
                ready = g.add(r, "gemm", "reduce",
                              cost.reduce_time_ms(3 * rows * c.n * acc_elt, c.hw),
                              deps=(ready, send[(g.peer((r - 1) % w), s - 1)]), label=f"add {dst}", chunk=dst)
            if s < w - 1:
                send[(r, s)] = g.add(r, "comm", "comm", c.xfer(rows * c.n * acc_elt, "p2p"),
                                     deps=(ready,), label=f"send {dst}", chunk=dst)
                g.pairs.append((r, gt, send[(r, s)]))
            else:
                finals[r] = g.add(r, "gemm", "reduce", cost.cast_time_ms(rows * c.n, acc, c.dtype, c.hw),
                                  deps=(ready,), label="downcast", chunk=dst)
    return finals


def ring_all_reduce(g: Graph, c: Ctx) -> None:
    """ring gemm_ar (strategies/ring.py)."""
    w = c.w
    # ring reduce-scatter (as gemm_rs, downcast into the output) then a ring all-gather of
    # the reduced shards in the op's dtype, step by step (exposed).
    finals = ring_reduce_scatter(g, c)
    shard_rows = c.shard_rows()
    for r in g.ranks:  # the all-gather's steps
        c.host_steps(g, r, w - 1)
    recv = {}
    for s in range(1, w):
        for r in g.ranks:
            src = (r - s) % w
            left = g.peer((r - 1) % w)
            prev = recv.get((left, s - 1), finals[left] if s == 1 else None)
            recv[(r, s)] = g.add(r, "comm", "comm", c.xfer(shard_rows[src] * c.n * c.elt, "p2p"),
                                 deps=(prev, finals[r]), label=f"ag {src}", chunk=src)


def publish(g: Graph, c: Ctx, shard_rows: list[int], *, gathered: bool = False,
            wait_all: bool = False) -> dict[int, int]:
    """AG over symmetric memory: ONE launch on the compute stream (``flags.publish_kernel``) that
    waits for the credits, copies this rank's shard into its own slot -- and, ``gathered``
    (copy_engine, fused), into the gathered output's own rows (one read, two writes) -- and
    raises READY on every peer; ``wait_all`` (copy_engine, fused): then, in the same launch,
    waits for every peer's READY.  Returns rank -> the task after which the rank's pulls may
    start: that wait (``wait_all``), else the launch (READY is raised at its end; the pulls
    wait for the peer's own)."""
    ready = {}
    for r in g.ranks:
        nbytes = shard_rows[r] * c.k * c.elt
        ready[r] = g.add(r, "gemm", "copy", cost.reduce_time_ms((3 if gathered else 2) * nbytes, c.hw),
                         label="publish", chunk=r, launch=True)
    if not wait_all:
        return ready
    return {r: g.flag(r, "gemm", "wait READY all", deps=tuple(ready[q] for q in g.ranks), launch=False)
            for r in g.ranks}


def pull_then_gemm_per_chunk(g: Graph, c: Ctx, path: str = "ce") -> None:
    """copy_engine ag_gemm: the publish launch (the local shard into the gathered buffer too;
    then the wait for every peer's READY), then the side stream pulls each peer's shard,
    nearest peer first (r+1, r+2, ...); the compute stream runs the local GEMM, then one cuBLAS
    GEMM per shard as it lands; the call ends with the NaN fill's launch, which returns DONE."""
    w = c.w
    shard_rows = c.shard_rows()
    ready = publish(g, c, shard_rows, gathered=True, wait_all=True)
    for r in g.ranks:
        peers = [(r + d) % w for d in range(1, w)]
        arrived = {}
        after = ready[r]  # side.wait_stream(main)
        for p in peers:
            arrived[p] = g.add(r, "comm", "comm", c.xfer(shard_rows[p] * c.k * c.elt, path), deps=(after,),
                               label=f"pull {p}", chunk=p, launch=True)
            after = None
        g.add(r, "gemm", "gemm", c.gemm(shard_rows[r]), label=f"GEMM {r}", chunk=r, launch=True)
        for p in peers:
            t = g.add(r, "gemm", "gemm", c.gemm(shard_rows[p]), deps=(arrived[p],), label=f"GEMM {p}", chunk=p,
                      launch=True)
            g.pairs.append((r, arrived[p], t))
        g.flag(r, "gemm", "NaN fill + DONE")


def pull_pieces_into_one_gemm(g: Graph, c: Ctx, path: str = "ce", move: Move | None = None,
                              workers: bool = False) -> None:
    """fused ag_gemm: the side stream pulls every peer's shard as copy_engine does, in
    ``num_chunks / W`` pieces, each followed by its arrival word; ONE persistent GEMM launch
    visits its M-tiles in round order from the local chunk, each band waiting for the pieces
    its rows touch.  ``move``: a piece's transfer time (None: ``path``'s); ``workers``
    (sm_workers): one worker launch does every READY wait, pull and arrival word (one host
    call), and the local shard and its arrival words are launches of their own, the words'
    reset and the NaN fill two more at the end; without, the publish launch writes the local
    shard into the gathered buffer, sets its words and waits for every peer's READY, and the
    NaN fill's launch resets the words and returns DONE."""
    w = c.w
    move = move or (lambda nbytes: c.xfer(nbytes, path))
    shard_rows = c.shard_rows()
    pieces = c.num_chunks // w
    sizes = [p for q in range(w) for p in split_rows(shard_rows[q], pieces)]
    bounds = row_bounds(sizes)
    total = bounds[-1][1]
    core = cost.core_gemm_time_ms(total, c.n, c.k, c.dtype, c.hw, hook="wait", num_sms=c.gemm_sms)
    ready = publish(g, c, shard_rows, gathered=not workers, wait_all=not workers)
    for r in g.ranks:
        me = c.layout_rank(g, r)
        after = ready[r]  # side.wait_stream(main) follows it
        if workers:
            g.add(r, "gemm", "copy", cost.copy_time_ms(shard_rows[me] * c.k * c.elt, c.hw), label="local shard",
                  chunk=me, launch=True)
            after = g.flag(r, "gemm", f"arrived {me}")
        arrived: dict[int, int] = {}
        first = True   # with workers: the one launch
        for d in range(1, w):
            q = (me + d) % w
            if workers:
                g.add(r, "comm", "flag", 0.0, deps=(after, ready[g.peer(q)]), label=f"wait READY {q}", launch=first)
                after, first = None, False
            for p in range(pieces):
                i = q * pieces + p
                lo, hi = bounds[i]
                g.add(r, "comm", "comm", move((hi - lo) * c.k * c.elt), deps=(after,), label=f"pull {q}.{p}",
                      chunk=i, launch=not workers)
                after = None
                arrived[i] = g.add(r, "comm", "flag", 0.0, label=f"arrived {q}.{p}", launch=not workers)
        if workers:
            g.flag(r, "comm", "DONE")
        first, consumed = True, set()
        for lo, hi, a, b in _bands(bounds, bounds[me * pieces][0], c.tile_m):
            deps = tuple(arrived[i] for i in range(a, b + 1) if i in arrived)
            t = g.add(r, "gemm", "gemm", core * (hi - lo) / max(total, 1), deps=deps, label=f"tiles {lo}:{hi}",
                      chunk=a, launch=first, issue_us=c.hw.host_core_call_us)
            first = False
            for i in range(a, b + 1):
                if i in arrived and i not in consumed:  # the piece's first consumer (for the backlog)
                    consumed.add(i)
                    g.pairs.append((r, arrived[i], t))
        if workers:
            g.flag(r, "gemm", "reset words")
            g.flag(r, "gemm", "NaN fill")
        else:
            g.flag(r, "gemm", "NaN fill + reset words + DONE")


def scatter_partials(g: Graph, c: Ctx, bounds: list[tuple[int, int]], path: str = "ce") -> dict[int, list[int]]:
    """copy_engine's phase 1 of gemm_rs/gemm_ar: per owner from rank + 1, a cuBLAS GEMM of its
    rows, then (side stream) the copy into the owner's inbox; the own rows last; then the compute
    stream joins the side stream and raises READY to every owner (in the launch that waits for
    the peers' READY next: the caller's ``ready_first``).  Returns rank -> the tasks the rank's
    reduce waits for (READY from every peer)."""
    w = c.w
    ready = {}
    for r in g.ranks:
        g.flag(r, "gemm", "begin")
        pushes = []
        for d in range(1, w):
            p = (r + d) % w
            rows = bounds[p][1] - bounds[p][0]
            gt = g.add(r, "gemm", "gemm", c.gemm(rows), label=f"GEMM {p}", chunk=p, launch=True)
            pushes.append(g.add(r, "comm", "comm", c.xfer(rows * c.n * c.elt, path), deps=(gt,), label=f"push {p}",
                                chunk=p, launch=True))
            g.pairs.append((r, gt, pushes[-1]))
        g.add(r, "gemm", "gemm", c.gemm(bounds[r][1] - bounds[r][0]), label=f"GEMM {r}", chunk=r, launch=True)
        g.add(r, "gemm", "flag", 0.0, deps=tuple(pushes), label="join the pushes")
        ready[r] = g.flag(r, "gemm", "READY")
    return {r: list(ready.values()) if g.symmetric else [ready[q] for q in range(w) if q != r]
            for r in g.ranks}


def _partials_by_owner(g: Graph, c: Ctx, send, own_rows) -> dict[int, list[int]]:
    """What the phase-1 schedules of gemm_rs/gemm_ar share: per rank, "begin", then for every
    owner p from rank + 1 on ``send(r, p)`` (its tasks; returns the READY task raised on p),
    then ``own_rows(r)`` (the own rows' GEMM task).  Returns rank -> the tasks the rank's reduce
    waits for: READY from every peer, then its own GEMM."""
    w = c.w
    incoming: dict[int, list[int]] = {r: [] for r in range(w)}
    sent: list[int] = []
    own = {}
    for r in g.ranks:
        g.flag(r, "gemm", "begin")
        for d in range(1, w):
            p = (r + d) % w
            sig = send(r, p)
            incoming[p].append(sig)
            sent.append(sig)
        own[r] = own_rows(r)
    # symmetric: the partials every peer sends rank 0 are rank 0's own sends, rotated
    return {r: (sent if g.symmetric else incoming[r]) + [own[r]] for r in g.ranks}


def epilogue_store_partials(g: Graph, c: Ctx, bounds: list[tuple[int, int]]) -> dict[int, list[int]]:
    """fused's phase 1 of gemm_rs/gemm_ar: ONE persistent GEMM launch in owner order (rank + 1
    first, own rows last) whose epilogue stores every finished band's rows into their owners'
    inboxes (SM stores over the link, egress in order, overlapping the later bands' compute);
    the launch ends when its stores have; then READY to every owner (the launch that waits for
    the peers' READY next: the caller's ``ready_first``).  Returns rank -> the tasks the rank's
    reduce waits for (READY from every peer)."""
    w = c.w
    total = bounds[-1][1]
    core = cost.core_gemm_time_ms(total, c.n, c.k, c.dtype, c.hw, hook="epilogue", num_sms=c.gemm_sms)
    ready = {}
    for r in g.ranks:
        me = c.layout_rank(g, r)
        g.flag(r, "gemm", "begin")
        first = True
        stores = []
        for lo, hi, a, b in _bands(bounds, bounds[(me + 1) % w][0], c.tile_m):
            tiles = -(-(hi - lo) // c.tile_m)
            for part in split_rows(tiles, max(1, min(_STORE_PARTS, tiles))):
                phi = min(hi, lo + part * c.tile_m)
                t = g.add(r, "gemm", "gemm", core * (phi - lo) / max(total, 1), label=f"tiles {lo}:{phi}",
                          chunk=a, launch=first, issue_us=c.hw.host_core_call_us)
                first = False
                for q in range(a, b + 1):
                    rows = min(phi, bounds[q][1]) - max(lo, bounds[q][0])
                    if q != me and rows > 0:
                        stores.append(g.add(r, "comm", "comm", c.xfer(rows * c.n * c.elt, "sm"), deps=(t,),
                                            label=f"store {q} {lo}:{phi}", chunk=q))
                        g.pairs.append((r, t, stores[-1]))
                lo = phi
        g.add(r, "gemm", "flag", 0.0, deps=tuple(stores), label="GEMM end (stores drained)")
        ready[r] = g.flag(r, "gemm", "READY")
    return {r: list(ready.values()) if g.symmetric else [ready[q] for q in range(w) if q != r]
            for r in g.ranks}


def reduce_owned(g: Graph, c: Ctx, waits: dict[int, list[int]], rows: dict[int, int], label: str, *,
                 ready_first: bool = False, done_in_reduce: bool = True) -> dict[int, int]:
    """The owner's side: wait READY from every peer (``ready_first``: in the launch that raised
    this rank's READY, no call of its own), then the fp32 reduce kernel over its W inbox slots
    (reads W x rows x N of the op's dtype, writes rows x N), which raises DONE in its launch
    (``done_in_reduce``; else a flag launch of its own after it)."""
    out = {}
    for r in g.ranks:
        g.flag(r, "gemm", "wait READY", deps=tuple(waits[r]), launch=not ready_first)
        out[r] = g.add(r, "gemm", "reduce", cost.reduce_time_ms((c.w + 1) * rows[r] * c.n * c.elt, c.hw),
                       label=label, chunk=r, launch=True)
        if not done_in_reduce:
            g.flag(r, "gemm", "DONE")
    return out


def reduce_scatter(g: Graph, c: Ctx, partials: Partials, *, ready_first: bool = False,
                   done_in_reduce: bool = True) -> None:
    """gemm_rs over symmetric memory: ``partials`` sends every owner its rows (copy_engine's
    :func:`scatter_partials`, fused's :func:`epilogue_store_partials`), then every owner
    reduces its inbox (:func:`reduce_owned`, with ``ready_first`` and ``done_in_reduce``)."""
    shard_rows = c.shard_rows()
    waits = partials(g, c, row_bounds(shard_rows))
    reduce_owned(g, c, waits, {r: shard_rows[c.layout_rank(g, r)] for r in g.ranks}, "reduce",
                 ready_first=ready_first, done_in_reduce=done_in_reduce)


def one_shot_all_reduce(g: Graph, c: Ctx) -> None:
    """gemm_ar one-shot over symmetric memory (copy_engine; fused for small outputs)."""
    w = c.w
    # copy_engine one-shot: the whole partial into the own slot, then READY and the wait for the
    # peers' in one launch, then every rank reduces all W partials read in place from the peers'
    # slots (rank order), DONE in the reduce's launch
    ready = {}
    for r in g.ranks:
        g.flag(r, "gemm", "begin")
        g.add(r, "gemm", "gemm", c.gemm(c.m), label="GEMM", launch=True)
        ready[r] = g.flag(r, "gemm", "READY")
    nbytes = c.m * c.n * c.elt
    for r in g.ranks:
        g.flag(r, "gemm", "wait READY", deps=tuple(ready[g.peer(q)] for q in range(w) if q != r), launch=False)
        g.add(r, "gemm", "reduce", cost.peer_reduce_time_ms((w + 1) * nbytes, (w - 1) * nbytes, c.hw),
              label="reduce (peers in place)", launch=True)


def two_shot_all_reduce(g: Graph, c: Ctx, partials: Partials, path: str = "ce", move: Move | None = None,
                        workers: bool = False, ready_first: bool = False, one_launch: bool = False) -> None:
    """gemm_ar two-shot over symmetric memory: ``partials`` (as :func:`reduce_scatter`), then
    every rank gathers the reduced chunks (``path``: who moves them, or ``move``: a chunk's
    transfer time).

    copy_engine and fused (``tpfuse/strategies/_symm_steps.py`` ``gather_reduced``): one launch
    waits for the DONE2 credits of the last call and the peers' READY (``ready_first``: the
    launch that raised this rank's READY); the reduce writes the owner's sum into its gather
    slot and its rows of the output and raises DONE and READY2 in its launch; the compute stream
    then waits for every peer's READY2 (one launch) and pulls each peer's chunk (a copy each); the
    NaN fill's launch raises DONE2.
    ``one_launch`` (fused): those waits, pulls, NaN fill and DONE2 are ONE launch on the compute
    stream (``flags.gather_kernel``), the chunks one after another, each ``move`` long: the
    caller's SM-copy cost (fused: ``cost.worker_transfer_time_ms`` of the launch's programs).
    ``workers`` (sm_workers): the credit wait, the READY wait and the reduce (into the gather
    slot) are launches of their own, DONE and READY2 one more, the own rows a copy; one worker
    launch (side stream) waits for and pulls every chunk, then DONE2, then the NaN fill."""
    w = c.w
    move = move or (lambda nbytes: c.xfer(nbytes, path))
    sizes = [c.shard_rows()[0]] * w if c.even else split_rows(c.m, w)
    bounds = row_bounds(sizes)
    waits = partials(g, c, bounds)
    ready2 = {}
    after = {}
    for r in g.ranks:
        me = c.layout_rank(g, r)
        rows_bytes = sizes[me] * c.n * c.elt
        if workers:
            g.flag(r, "gemm", "wait DONE2 (last call)")
            g.flag(r, "gemm", "wait READY", deps=tuple(waits[r]))
            g.add(r, "gemm", "reduce", cost.reduce_time_ms((w + 1) * rows_bytes, c.hw), label="reduce", chunk=me,
                  launch=True)
            ready2[r] = g.flag(r, "gemm", "DONE + READY2")
            after[r] = g.add(r, "gemm", "copy", cost.copy_time_ms(rows_bytes, c.hw), label="own chunk", chunk=me,
                             launch=True)
        else:
            g.flag(r, "gemm", "wait DONE2 (last call)", launch=not ready_first)
            g.flag(r, "gemm", "wait READY", deps=tuple(waits[r]), launch=False)
            ready2[r] = g.add(r, "gemm", "reduce", cost.reduce_time_ms((w + 2) * rows_bytes, c.hw),
                              label="reduce (+ own rows, DONE, READY2)", chunk=me, launch=True)
    single = workers or one_launch   # every wait and pull in one launch
    for r in g.ranks:
        me = c.layout_rank(g, r)
        engine = "comm" if workers else "gemm"
        dep = after.get(r)  # workers: side.wait_stream(main)
        peers = [(me + d) % w for d in range(1, w)]
        if not single:   # copy_engine: one wait launch for every peer's READY2, then a copy per peer
            g.flag(r, engine, "wait READY2 all", deps=tuple(ready2[g.peer(p)] for p in peers))
        for d, p in enumerate(peers, start=1):
            if single:
                g.add(r, engine, "flag", 0.0, deps=(dep, ready2[g.peer(p)]), label=f"wait READY2 {p}",
                      launch=d == 1)
                dep = None
            g.add(r, engine, "comm", move(sizes[p] * c.n * c.elt), label=f"gather {p}",
                  chunk=p, launch=not single)
        if workers:
            g.flag(r, "comm", "DONE2")
            g.flag(r, "gemm", "NaN fill")
        else:
            g.flag(r, "gemm", "NaN fill + DONE2", launch=not one_launch)


def staged_partials(g: Graph, c: Ctx, bounds: list[tuple[int, int]], *, move: Move, slots: int,
                    chunk_rows: int | None = None, producer_sms: int | None = None) -> dict[int, list[int]]:
    """sm_workers' phase 1 of gemm_rs/gemm_ar: each peer owner's rows from rank + 1 on, in
    pieces of at most ``chunk_rows`` rows (None: one piece per owner), piece j through ring
    slot j % ``slots``.  The compute stream, per piece: the credit wait (piece j - slots pushed:
    its slot is FREE), a cuBLAS GEMM of the piece into the slot on the ``producer_sms`` SMs the
    workers leave, READY of the slot; ONE worker launch (comm engine, issued first) pushes the
    pieces in order (``move``), READY to an owner after its last piece, no host call of its
    own beyond the launch; the own rows' GEMM last, then the compute stream waits for the
    workers (the ring's words are reset).  Returns rank -> the tasks the rank's reduce waits
    for (READY from every peer; its own GEMM), as :func:`scatter_partials`."""
    if slots < 1:
        raise ValueError(f"slots: {slots} must be >= 1")
    pushes: list[int] = []   # this rank's pushes, in ring order (emptied after each rank)

    def send(r: int, p: int) -> int:
        lo, hi = bounds[p]
        step = max(1, hi - lo if chunk_rows is None else chunk_rows)
        cuts = list(range(lo, hi, step)) or [lo]
        for x, start in enumerate(cuts):
            j = len(pushes)
            rows = min(hi, start + step) - start
            if j >= slots:
                g.flag(r, "gemm", f"credit {j}", deps=(pushes[j - slots],))
            gt = g.add(r, "gemm", "gemm", c.gemm(rows, num_sms=producer_sms), label=f"GEMM {p}.{x}", chunk=p,
                       launch=True)
            ready = g.flag(r, "gemm", f"ready {j}")
            pushes.append(g.add(r, "comm", "comm", move(rows * c.n * c.elt), deps=(ready,),
                                label=f"push {p}.{x}", chunk=p, launch=j == 0))
            g.pairs.append((r, gt, pushes[-1]))
        return g.add(r, "comm", "flag", 0.0, label=f"READY {p}")

    def own_rows(r: int) -> int:
        own = g.add(r, "gemm", "gemm", c.gemm(bounds[r][1] - bounds[r][0], num_sms=producer_sms),
                    label=f"GEMM {r}", chunk=r, launch=True)
        g.flag(r, "gemm", "reset words", deps=tuple(pushes[-1:]))   # the compute stream waits for the workers
        pushes.clear()
        return own

    return _partials_by_owner(g, c, send, own_rows)
