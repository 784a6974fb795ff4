"""The cheapest correct host-side launch of an already compiled Triton kernel (issue 34.4).

Every tpfuse kernel launches through Triton's JIT the first time (which compiles and returns the
``CompiledKernel``) and directly afterwards (tpfuse/symm.py, tpfuse/gemm/launch.py).  Triton's own
direct path, ``compiled[grid](*args, stream=s)``, still builds a closure, reads the launch hooks
and builds their metadata on every launch (about 10 us of host time per launch on the H200 bed's
host, five to nine launches per op call).  :class:`Direct` makes the same final call into the
kernel's launcher with that metadata left out, which is what Triton itself passes when no launch
hook is set.  It does so only where Triton's runner is read (once, from its source) to make exactly
that call, and while no launch hook is set (a profiler such as proton sets them); otherwise, and
after any failure of the short path (warned once), it launches through ``compiled[grid]``.
"""
from __future__ import annotations

import functools
import inspect
import warnings

__all__ = ["Direct"]

# The call Triton's CompiledKernel runner makes (3.4 through 3.6 at least), whitespace-normalized.
_RUNNER_CALL = ("self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata, "
                "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *args)")
_SHORT_BROKEN = [False]


@functools.lru_cache(maxsize=1)
def _runtime_knobs():
    """Triton's runtime knobs (the launch hooks) where its runner makes :data:`_RUNNER_CALL`, else None."""
    try:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel

        source = " ".join(inspect.getsource(CompiledKernel.__getitem__).split())
    except Exception:   # noqa: BLE001 - another Triton: its own launch path, always
        return None
    return knobs.runtime if _RUNNER_CALL in source else None


def _idle(hook) -> bool:
    """No launch hook: None, or an empty ``HookChain`` (Triton >= 3.5 always has one)."""
    return hook is None or not getattr(hook, "calls", True)


class Direct:
    """``compiled[grid](*args, stream=stream)`` for one ``CompiledKernel`` (``args``: every
    parameter in signature order, constexprs included; ``grid``: three ints), as cheaply as
    this Triton allows."""

    __slots__ = ("compiled", "run", "function", "packed", "knobs")

    def __init__(self, compiled):
        self.compiled = compiled
        self.knobs = None if _SHORT_BROKEN[0] else _runtime_knobs()
        if self.knobs is not None:
            self.run = compiled.run          # loads the module (as compiled[grid] does)
            self.function = compiled.function
            self.packed = compiled.packed_metadata

    def __call__(self, grid: tuple, stream: int, args) -> None:
        rt = self.knobs
        if rt is not None and _idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook) and not _SHORT_BROKEN[0]:
            try:
                self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed, None, None, None, *args)
                return
            except Exception as exc:   # noqa: BLE001 - the launcher refused its arguments: nothing was launched
                warnings.warn(f"tpfuse: the short kernel launch failed ({type(exc).__name__}: {exc}); launching "
                              f"through Triton's CompiledKernel from now on (slower on the host)", RuntimeWarning,
                              stacklevel=3)
                _SHORT_BROKEN[0] = True
        self.compiled[grid](*args, stream=stream)
