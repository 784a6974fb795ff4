"""The producer side of the wait hook's late-release GPU tests (test_gemm_core.py, test_gemm_pp_gpu.py)."""
from __future__ import annotations

import torch


def release_chunks(a, src, signal, chunk_m, gen, delay_cycles, stream):
    """On ``stream``: after ``delay_cycles`` of ``torch.cuda._sleep``, ``src`` copied into ``a``
    chunk by chunk, last chunk first, each chunk's ``signal`` raised to ``gen`` after its rows."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(delay_cycles)
        for c in reversed(range(signal.numel())):
            a[c * chunk_m:(c + 1) * chunk_m].copy_(src[c * chunk_m:(c + 1) * chunk_m])
            signal[c:c + 1].fill_(gen)
