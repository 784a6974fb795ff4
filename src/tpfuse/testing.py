"""Reference checks shared by the CPU and GPU test suites (and usable inside spawned ranks).

The rule (DESIGN.md §6, STYLE §8): compare against a float64 reference of the same rounded
inputs, with a tolerance derived from the *baseline's own error in the same dtype* -- the
unfused strategy for the ops, ``torch.matmul`` for the GEMM core -- times a small factor,
plus a small floor; NaN and Inf never pass (outputs are poisoned with NaN first, so an element
never written shows up as NaN).

=====================  =====================================================================
function               use
=====================  =====================================================================
``rel_err``            relative error of ``out`` against ``ref`` (max-abs or Frobenius); NaN
                       if ``out`` has a NaN or Inf, so it fails every bound
``tolerance``          ``k * baseline + dtypes.rounding_floor(dtype)``
``check_close``        None or a sentence saying what is wrong (for rank workers that return
                       their failures)
``assert_close``       the same as an assertion
``matmul_reference``   float64 product of the given (rounded) operands
``matmul_baseline``    ``torch.matmul``'s own error on them, in their dtype (tf32 for float32
                       on CUDA, as the Triton core computes float32)
``Reference``          both of those for one GEMM, sliced together (``ref[rows]``), so a
                       check of any block of the output knows its baseline
=====================  =====================================================================
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Union

import torch

from tpfuse import dtypes

__all__ = ["K", "rel_err", "tolerance", "check_close", "assert_close", "matmul_reference",
           "matmul_baseline", "Reference"]

# The factor on the baseline's error: other strategies reduce in another order, or with other
# tiles, but no less precisely.
K = 3


def rel_err(out: torch.Tensor, ref: torch.Tensor, norm: str = "max") -> float:
    """``|out - ref| / |ref|`` in the ``norm`` ("max": largest element, "fro": Frobenius) on
    float64; 0 for empty tensors; NaN when ``out`` holds NaN or Inf."""
    if ref.numel() == 0:
        return 0.0
    out = out.detach().double().to(ref.device)
    if not torch.isfinite(out).all():
        return float("nan")
    diff, ref = out - ref, ref.double()
    if norm == "max":
        return (diff.abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    if norm == "fro":
        return (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    raise ValueError(f"rel_err: norm={norm!r}; use 'max' or 'fro'")


def tolerance(dtype: torch.dtype, baseline: float, k: float = K) -> float:
    """The error a result of ``dtype`` may have: ``k`` times the baseline's plus about one rounding of ``dtype`` (:func:`tpfuse.dtypes.rounding_floor`)."""
    return k * baseline + dtypes.rounding_floor(dtype)


@dataclass(frozen=True)
class Reference:
    """One GEMM's float64 product (``exact``) and the baseline's result in the operands' dtype
    (``baseline``: ``torch.matmul``), sliced together: ``ref[r0:r1]`` is the reference of those
    rows, with their own baseline error."""
    exact: torch.Tensor
    baseline: torch.Tensor

    @classmethod
    def of(cls, a: torch.Tensor, b: torch.Tensor) -> "Reference":
        tf32 = a.is_cuda and a.dtype == torch.float32
        with _allow_tf32() if tf32 else contextlib.nullcontext():
            got = torch.matmul(a, b)
        return cls(matmul_reference(a, b), got)

    def __getitem__(self, index) -> "Reference":
        return Reference(self.exact[index], self.baseline[index])

    @property
    def shape(self):
        return self.exact.shape

    def baseline_error(self, norm: str = "max") -> float:
        return rel_err(self.baseline, self.exact, norm)


def check_close(out: torch.Tensor, ref: Union[torch.Tensor, Reference], *, baseline: Optional[float] = None,
                dtype: Optional[torch.dtype] = None, k: float = K, norm: str = "max",
                what: str = "output") -> Optional[str]:
    """None if ``out`` matches ``ref`` within :func:`tolerance`, else why not (shape, NaN/Inf,
    or the error against the bound). ``ref``: a float64 tensor with ``baseline`` the
    baseline's error, or a :class:`Reference` (``baseline`` then defaults to its own)."""
    if isinstance(ref, Reference):
        baseline = ref.baseline_error(norm) if baseline is None else baseline
        ref = ref.exact
    if baseline is None:
        raise TypeError("check_close: pass baseline= (the baseline's error) or a Reference")
    dtype = dtype or out.dtype
    if tuple(out.shape) != tuple(ref.shape):
        return f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if out.numel() and not torch.isfinite(out).all():
        return f"{what}: NaN/Inf in the output (an element never written?)"
    err, bound = rel_err(out, ref, norm), tolerance(dtype, baseline, k)
    if not err <= bound:
        return f"{what}: {norm} relative error {err:.3e} > {k} x baseline {baseline:.3e} + floor {dtypes.rounding_floor(dtype):.0e}"
    return None


def assert_close(out: torch.Tensor, ref: Union[torch.Tensor, Reference], *, baseline: Optional[float] = None,
                 dtype: Optional[torch.dtype] = None, k: float = K, norm: str = "max", what: str = "output") -> None:
    """:func:`check_close` as an assertion."""
    problem = check_close(out, ref, baseline=baseline, dtype=dtype, k=k, norm=norm, what=what)
    assert problem is None, problem


def matmul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float64 of the operands as given (already rounded to their dtype)."""
    return a.double() @ b.double()


def matmul_baseline(a: torch.Tensor, b: torch.Tensor, ref: Optional[torch.Tensor] = None,
                    norm: str = "max") -> float:
    """The error of ``torch.matmul(a, b)`` in the operands' dtype against ``ref`` (default: the
    float64 product): the unfused path's GEMM, so the bound for the Triton core's. float32 on
    CUDA runs with tf32 allowed, since the Triton core computes float32 through tf32."""
    r = Reference.of(a, b)
    return rel_err(r.baseline, r.exact if ref is None else ref, norm)


@contextlib.contextmanager
def _allow_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
