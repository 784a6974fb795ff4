"""Integer constants that the kernels and their host side (``tpfuse/gemm``) must agree on.

Plain Python, no Triton: the host side imports this without importing a kernel, and every
kernel module wraps the values it needs in ``tl.constexpr`` (``gemm.py``, ``gemm_ws.py``,
``signals.py``). Change a value here and both sides change together.
"""

# Tile orders, by the kernels' TILE_ORDER constexpr (index into this tuple).
TILE_ORDERS = ("grouped", "round", "owner")

# Error word: int32[ERROR_WORDS], zero = no error, ONE layout for every bounded wait (the
# workspace's flag kernels, tpfuse/kernels/flags.py, and the GEMM's wait hook,
# tpfuse/kernels/signals.py: record_timeout). The first waiter that times out wins it by a CAS
# on ERR_STATUS (device memory) and fills in the rest; a word whose ERR_STATUS is not ERR_OK
# means "broken": every later kernel of its workspace stops waiting, signals nothing and fills
# its outputs with NaN. Word indices:
ERROR_WORDS = 16
ERR_OK = 0
ERR_WAIT_TIMEOUT = 1
ERR_STATUS = 0       # ERR_WAIT_TIMEOUT once a wait timed out
ERR_WHAT = 1         # what was awaited: a WAIT_* code below
ERR_PEER = 2         # group rank whose flag never arrived (-1: not known to the kernel)
ERR_GENERATION = 3   # the value awaited (flag >= generation)
ERR_SEEN = 4         # last value seen in the flag
ERR_RANK = 5         # the waiting rank (-1: not known to the kernel, e.g. the GEMM's hook)
ERR_CHUNK = 6        # GEMM wait hook, sm_workers: the chunk whose signal never arrived (-1 otherwise)
ERR_TILE = 7         # GEMM wait hook: linear tile id in tile-order space; WAIT_SLOT_FREE: the ring slot (-1 otherwise)
ERR_PROGRAM = 8      # GEMM wait hook, sm_workers' worker CTAs: the program that timed out (-1 otherwise)
ERR_MIRROR = 14      # words [14:16]: int64 address of a host-visible copy (pinned memory, UVA;
                     # 0 = none). After winning the CAS the recorder copies words [1:9] there,
                     # then ERR_STATUS last, so the host reads the record without a device sync.
ERR_RECORD_WORDS = 9 # words [0:9] are the record (the mirror holds the same layout)

# WAIT_* codes (word ERR_WHAT), and what a timeout of each means, in the user's words
# (tpfuse/symm.py, tpfuse/watchdog.py).
WAIT_CREDIT = 1      # a peer to finish reading this rank's buffer from the previous call
WAIT_READY = 2       # a peer to publish its data for this call
WAIT_CREDIT2 = 3     # a peer to finish reading this rank's gather buffer from the previous call
WAIT_READY2 = 4      # a peer to publish its reduced rows for this call
WAIT_GEMM_CHUNK = 5  # the GEMM's wait hook: a chunk of A to land (the chunk's copy never finished)
WAIT_SLOT_FREE = 6   # sm_workers' producer: its worker CTAs to drain a staging-ring slot (a credit)
WAIT_SLOT_READY = 7  # sm_workers' worker CTAs: their producer to fill a staging-ring slot

# EPI_TMA (the epilogue hook's stores): 0 = pointer stores, 1..MAX_TMA_DESTS = one TMA
# descriptor per chunk, EPI_TMA_STACKED = one descriptor over destinations stacked as the rows
# of one tensor (any number of chunks of any height).
MAX_TMA_DESTS = 8
EPI_TMA_STACKED = 9

# EPILOGUE (the kernels' epilogue hook constexpr): 0 off; EPI_SIGNALLED: route each row to its
# chunk's destination, count the stored tiles, publish a chunk once complete; EPI_ROUTE: route
# only (an EpilogueSpec without signals: the fused GEMM+RS/AR, whose owners learn of the rows
# from READY after the launch), no count, no fence, no publication.
EPI_SIGNALLED = 1
EPI_ROUTE = 2

# EPI_COUNT (how the epilogue hook counts stored tiles; docs/gemm_core.md, "Hooks' contract"):
EPI_COUNT_RETURNING = 1   # acq_rel at GPU scope, read at once; the chunk's last count publishes
EPI_COUNT_AFTER_LOOP = 3  # a release that returns nothing, after the next tile's main loop; a poller per chunk
EPI_COUNT_IN_LOOP = 4     # as 3, made COUNT_STEP K-steps into the next tile's main loop (flattened loops)
COUNT_STEP = 4

# Counts 3 and 4: a chunk's poller hands it off by adding HANDOFF to its counter, so a chunk's
# tile count must stay below it; the end of a program checks at most MAX_POLLED_CHUNKS chunks.
HANDOFF = 1 << 24
MAX_POLLED_CHUNKS = 64

# The Gluon kernel (gemm_ws.py) launches with 8 MMA warps and two one-warp workers (one
# warpgroup): 12 warps x 168 registers = 64512 of the SM's 65536; the workers drop to 40
# (setmaxnreg, the kernel's worker_num_regs), so the MMA warps get 232 for their 128
# accumulator registers (128 x 256 fp32 over 256 threads) and the rest.
WS_NUM_WARPS = 8
WS_MAXNREG = 168

# Per-tile timeline (matmul(tile_records=...); off by default, the kernels' RECORD_TILES
# constexpr): an int64 [num_tiles, TILE_RECORD_COLUMNS] tensor, row t = tile t of the launched
# kernel's tile grid, t = pid_m * ceil(N / BLOCK_N) + pid_n (rows [pid_m * BLOCK_M, ...) of the
# output; not the position in the tile order). Columns:
REC_TILE = 0        # t itself (a row still holding -1 was not written)
REC_PROGRAM = 1     # the persistent program that ran the tile (tl.program_id(0))
REC_SM = 2          # %smid of that program's SM; -1 without inline PTX
REC_START_NS = 3    # before the tile's wait hook and main loop
REC_WAIT_NS = 4     # after the wait hook returned (= REC_START_NS without a wait hook)
REC_END_NS = 5      # after the tile's stores (gemm_ws_kernel: and its epilogue hook's count)
TILE_RECORD_COLUMNS = 6
# Times are %globaltimer nanoseconds with inline PTX; without it (TRITON_INTERPRET=1,
# GemmOptions(signal_asm=False)) a logical clock per program: its i-th work item (tile, or
# stream-K segment) reads 3 * i, 3 * i + 1, 3 * i + 2 at start, wait done and end.
REC_CLOCK_STEPS = 3
