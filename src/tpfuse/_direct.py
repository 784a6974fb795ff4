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
# The call Triton's CudaLauncher makes once it has its scratch buffers (3.5 and 3.6 at least).
_LAUNCHER_CALL = ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
                  "global_scratch, profile_scratch, *args)")
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


@functools.lru_cache(maxsize=None)
def _launcher_call_known(cls) -> bool:
    """Whether launcher class ``cls`` (``CudaLauncher``) ends in :data:`_LAUNCHER_CALL`."""
    try:
        return _LAUNCHER_CALL in " ".join(inspect.getsource(cls.__call__).split())
    except Exception:   # noqa: BLE001
        return False


class Direct:
    """``compiled[grid](*args, stream=stream)`` for one ``CompiledKernel`` (``args``: every
    parameter in signature order, constexprs included; ``grid``: three ints), as cheaply as
    this Triton allows."""

    __slots__ = ("compiled", "run", "launch", "function", "packed", "head", "knobs")

    def __init__(self, compiled):
        self.compiled = compiled
        self.knobs = None if _SHORT_BROKEN[0] else _runtime_knobs()
        self.launch = None
        if self.knobs is not None:
            run = self.run = compiled.run          # loads the module (as compiled[grid] does)
            self.function = compiled.function
            self.packed = compiled.packed_metadata
            # A kernel with no scratch memory (every tpfuse kernel so far) skips the launcher's
            # scratch allocation step too: its C launch gets None for both, as from there.
            if (_launcher_call_known(type(run)) and not getattr(run, "global_scratch_size", 1)
                    and not getattr(run, "profile_scratch_size", 1)):
                self.launch = run.launch
                self.head = (run.launch_cooperative_grid, run.launch_pdl, None, None, self.packed, None, None, None)

    def __call__(self, grid: tuple, stream: int, args) -> None:
        rt = self.knobs
        if (rt is not None and not getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook is not None)
                and not getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook is not None) and not _SHORT_BROKEN[0]):
            try:
                if self.launch is not None:
                    self.launch(grid[0], grid[1], grid[2], stream, self.function, *self.head, *args)
                else:
                    self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed, None, None, None, *args)
                return
            except Exception as exc:   # noqa: BLE001 - the launcher refused its arguments: nothing was launched
                warnings.warn(f"tpfuse: the short kernel launch failed ({type(exc).__name__}: {exc}); launching "
                              f"through Triton's CompiledKernel from now on (slower on the host)", RuntimeWarning,
                              stacklevel=3)
                _SHORT_BROKEN[0] = True
        self.compiled[grid](*args, stream=stream)
