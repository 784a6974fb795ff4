"""The benchmark workload matrix of DESIGN §7, as data.

Per Llama-3 model size, per phase and per tensor-parallel degree W, two GEMMs:

| GEMM | op | M (full) | N (local) | K (local) |
|---|---|---|---|---|
| fc1 (gate+up, column parallel) | ``ag_gemm`` | tokens | 2 * ffn / W | h |
| fc2 (down, row parallel) | ``gemm_rs`` (``gemm_ar`` in decode) | tokens | h | ffn / W |

Phases: training M = 16384 tokens, prefill M = 4096, decode M = 128.  All shapes are the
per-rank shapes as the ops see them: ``m`` is the full M (``ag_gemm`` gets ``m / W`` rows per
rank), ``n`` and ``k`` are this rank's local sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODELS", "PHASES", "Workload", "workload_matrix", "WORKLOADS", "scaled_down"]

# name -> (hidden h, ffn intermediate size); Llama-3 model cards.
MODELS: dict[str, tuple[int, int]] = {
    "8b": (4096, 14336),
    "70b": (8192, 28672),
    "405b": (16384, 53248),
}
# phase -> tokens M per step (full, unsharded).
PHASES: dict[str, int] = {"training": 16384, "prefill": 4096, "decode": 128}


@dataclass(frozen=True)
class Workload:
    """One GEMM of the matrix: ``op`` on per-rank shapes (``m`` full, ``n``/``k`` local)."""

    model: str
    phase: str
    gemm: str  # "fc1" or "fc2"
    op: str  # "ag_gemm" | "gemm_rs" | "gemm_ar"
    m: int
    n: int
    k: int
    world_size: int
    dtype: str = "bf16"

    @property
    def name(self) -> str:
        return f"{self.model}-{self.phase}-{self.gemm}-tp{self.world_size}"

    @property
    def flops(self) -> int:
        """FLOPs of the local GEMM on one rank (full M rows for every op)."""
        return 2 * self.m * self.n * self.k


def _cells(model: str, phase: str, world_size: int, dtype: str) -> list[Workload]:
    h, ffn = MODELS[model]
    m = -(-PHASES[phase] // world_size) * world_size  # M divisible by W (SP shards rows)
    fc2_op = "gemm_ar" if phase == "decode" else "gemm_rs"
    return [
        Workload(model, phase, "fc1", "ag_gemm", m, 2 * ffn // world_size, h, world_size, dtype),
        Workload(model, phase, "fc2", fc2_op, m, h, ffn // world_size, world_size, dtype),
    ]


def workload_matrix(
    world_sizes: tuple[int, ...] = (2, 4, 8),
    dtype: str = "bf16",
    models: tuple[str, ...] = tuple(MODELS),
    phases: tuple[str, ...] = tuple(PHASES),
) -> list[Workload]:
    """Every (model, phase, W) cell as fc1 + fc2 workloads, in a stable order."""
    for name in models:
        if name not in MODELS:
            raise ValueError(f"models: unknown model {name!r}; choose from {sorted(MODELS)}")
    for name in phases:
        if name not in PHASES:
            raise ValueError(f"phases: unknown phase {name!r}; choose from {sorted(PHASES)}")
    for w in world_sizes:
        if w < 1:
            raise ValueError(f"world_sizes: {w} is not a positive integer")
    return [
        cell
        for model in models
        for phase in phases
        for w in world_sizes
        for cell in _cells(model, phase, w, dtype)
    ]


WORKLOADS: list[Workload] = workload_matrix()


def scaled_down(workload: Workload, factor: int) -> Workload:
    """The same cell with M, N, K divided by ``factor`` (rounded so M stays divisible by W).

    Used by ``tpfuse demo`` to run a Llama-shaped problem that finishes in seconds on CPU.
    """
    if factor < 1:
        raise ValueError(f"factor: {factor} must be >= 1")
    w = workload.world_size
    m = max(w, (workload.m // factor) // w * w)
    return Workload(
        workload.model, workload.phase, workload.gemm, workload.op, m,
        max(1, workload.n // factor), max(1, workload.k // factor), w, workload.dtype,
    )
