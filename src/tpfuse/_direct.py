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

    __slots__ = ("compiled", "run", "launch", "function", "packed", "head", "knobs", "tma")

    def __init__(self, compiled):
        self.compiled = compiled
        self.knobs = None if _SHORT_BROKEN[0] else _runtime_knobs()
        self.launch = self.tma = None
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
                self.tma = _tma_launcher(run.launch)

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


# --- kernels that take TMA tensor descriptors ------------------------------------------------
#
# Triton wraps the C launcher of such a kernel in a Python function (``wrap_handle_tensordesc``)
# that walks every argument of every launch and expands each host TensorDescriptor into the
# 128-byte CUtensorMap the driver takes, then its shape and strides.  For the Gluon GEMM (about
# 40 arguments, three to five descriptors) that walk and the descriptor objects the caller must
# build for it cost more host time than the rest of the launch.  :func:`launch_tma` takes the
# descriptors as (address, shape, strides) and calls the C launcher with them expanded the same
# way -- only where this Triton's wrapper and expansion are the ones read here (their source,
# whitespace-normalized), else the caller keeps Triton's own path.

# what wrap_handle_tensordesc's inner function does with a descriptor argument (3.5 and 3.6 at least)
_WRAP_CALL = "final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))"
# what make_tensordesc_arg builds from a descriptor with metadata
_MAKE_CALLS = ("cu_tensor_map = triton.runtime.driver.active.utils.fill_tma_descriptor( arg.base.data_ptr(), "
               "swizzle, elem_size, TMA_DTYPE_DEVICE_TO_HOST[elem_type], block_size, shape, strides, padding, )",
               "return [cu_tensor_map, *shape, *strides]")


@functools.lru_cache(maxsize=1)
def tma_expansion_known() -> bool:
    """Whether this Triton's CUDA launcher expands descriptors as read here (no GPU needed)."""
    try:
        from triton.backends.nvidia import driver

        wrap = " ".join(inspect.getsource(driver.wrap_handle_tensordesc).split())
        make = " ".join(inspect.getsource(driver.make_tensordesc_arg).split())
        return (_WRAP_CALL in wrap and all(c in make for c in _MAKE_CALLS)
                and getattr(driver, "_BASE_ARGS_FORMAT_LEN", None) == 13)
    except Exception:   # noqa: BLE001 - another Triton: its own path
        return False


@functools.lru_cache(maxsize=1)
def _tma_expansion() -> tuple | None:
    """(fill_tma_descriptor, the device-to-host dtype map) of the active CUDA driver where
    :func:`tma_expansion_known`, else None."""
    if not tma_expansion_known():
        return None
    try:
        import triton
        from triton.backends.nvidia import driver

        return triton.runtime.driver.active.utils.fill_tma_descriptor, dict(driver.TMA_DTYPE_DEVICE_TO_HOST)
    except Exception:   # noqa: BLE001
        return None


def _tma_launcher(launch) -> tuple | None:
    """(C launcher, descriptor positions, their metadata) of a launcher wrapped by Triton's
    ``wrap_handle_tensordesc`` (read off its closure), or None (no descriptors, or a wrapper or
    metadata this module does not know)."""
    code = getattr(launch, "__code__", None)
    if code is None or code.co_name != "inner" or _tma_expansion() is None:
        return None
    try:
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
        raw, positions, metas = cells["launcher"], sorted(cells["tensordesc_indices"]), list(cells["tensordesc_meta"])
    except Exception:   # noqa: BLE001
        return None
    if len(metas) != len(positions) or any(not isinstance(m, dict) or m.get("fp4_padded") for m in metas):
        return None
    keys = ("swizzle", "elem_size", "elem_type", "block_size")
    if any(any(k not in m for k in keys) for m in metas):
        return None
    # the block as a tuple: the metadata is part of the descriptor maps' key (list again for the fill)
    return raw, tuple(positions), tuple((m["swizzle"], m["elem_size"], m["elem_type"], tuple(m["block_size"]))
                                        for m in metas)


_MAPS: dict = {}   # (address, shape, strides, metadata) -> CUtensorMap argument


def _tensor_map(fill, to_host, ptr: int, shape: list, strides: list, meta: tuple):
    key = (ptr, *shape, *strides, meta)
    hit = _MAPS.get(key)
    if hit is None:
        swizzle, elem_size, elem_type, block = meta
        hit = fill(ptr, swizzle, elem_size, to_host[elem_type], list(block), shape, strides, 0)
        if len(_MAPS) >= 1024:
            _MAPS.clear()
        _MAPS[key] = hit
    return hit


def launch_tma(direct: "Direct", grid: tuple, stream: int, args: list, descs: dict) -> bool:
    """Launch ``direct``'s kernel with ``args`` (every parameter in signature order, constexprs
    included) where the parameter at each position ``i`` in ``descs`` is the descriptor
    ``descs[i] = (address, shape, strides)`` (zero padding; its block and layout are the
    kernel's).  False, launching nothing, where this path does not apply (another Triton, a
    launch hook set, other descriptor positions) or once it failed (warned once): the caller
    then builds Triton's descriptors and launches through ``direct``."""
    tma = direct.tma
    rt = direct.knobs
    if (tma is None or _SHORT_BROKEN[0] or _TMA_BROKEN[0]
            or getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook is not None)
            or getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook is not None)):
        return False
    raw, positions, metas = tma
    if descs.keys() != set(positions):
        return False
    fill, to_host = _tma_expansion()
    final = list(args)
    try:
        for pos, meta in zip(reversed(positions), reversed(metas)):   # from the back: earlier positions stay put
            ptr, shape, strides = descs[pos]
            shape, strides = list(shape), list(strides)
            final[pos:pos + 1] = [_tensor_map(fill, to_host, ptr, shape, strides, meta), *shape, *strides]
        raw(grid[0], grid[1], grid[2], stream, direct.function, *direct.head, *final)
    except Exception as exc:   # noqa: BLE001 - refused before launching: Triton's own path from now on
        warnings.warn(f"tpfuse: the launch with expanded TMA descriptors failed ({type(exc).__name__}: {exc}); "
                      f"building Triton's descriptors from now on (slower on the host)", RuntimeWarning, stacklevel=3)
        _TMA_BROKEN[0] = True
        return False
    return True


_TMA_BROKEN = [False]
