"""The short launch of kernels that take TMA descriptors (tpfuse/_direct.py, launch_tma): the C
launcher must get exactly what Triton's own descriptor wrapper would hand it.  No GPU: Triton's
wrapper runs on recorded calls with a fake ``fill_tma_descriptor``."""
from __future__ import annotations

import types

import pytest
import torch

triton = pytest.importorskip("triton")

from tpfuse import _direct  # noqa: E402


@pytest.fixture
def fake_driver(monkeypatch):
    """Triton's active driver with a fill_tma_descriptor that returns its arguments."""
    def fill(*args):
        return ("map",) + tuple(tuple(a) if isinstance(a, list) else a for a in args)

    monkeypatch.setattr(triton.runtime.driver, "_active",
                        types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=fill)))
    _direct._tma_expansion.cache_clear()
    _direct._MAPS.clear()
    monkeypatch.setattr(_direct, "_TMA_BROKEN", [False])
    yield
    _direct._tma_expansion.cache_clear()
    _direct._MAPS.clear()


def _triton_and_ours(metas, signature, args, descs):
    from triton import knobs
    from triton.backends.nvidia import driver

    calls = []
    inner = driver.wrap_handle_tensordesc(lambda *a: calls.append(a), signature, metas)
    base = (2, 1, 1, 77, "fn", False, False, None, None, "packed", None, None, None)
    inner(*base, *args)
    ours = types.SimpleNamespace(tma=_direct._tma_launcher(inner), knobs=knobs.runtime, function="fn",
                                 head=(False, False, None, None, "packed", None, None, None))
    assert ours.tma is not None
    # ours takes the descriptors as (address, shape, strides) in place of the objects
    plain = [None if i in descs else a for i, a in enumerate(args)]
    assert _direct.launch_tma(ours, (2, 1, 1), 77, plain, descs) is True
    return calls


def test_expanded_descriptors_match_tritons_wrapper(fake_driver):
    if not _direct.tma_expansion_known():
        pytest.skip(f"Triton {triton.__version__} expands descriptors its own way: the short path stays off")
    a = torch.empty(64, 48, dtype=torch.bfloat16)
    c = torch.empty(64, 32, dtype=torch.float32)
    meta_a = dict(swizzle=128, elem_size=2, elem_type=10, block_size=[64, 32], fp4_padded=False)
    meta_c = dict(swizzle=64, elem_size=4, elem_type=7, block_size=[64, 16], fp4_padded=False)
    signature = {"a": "tensordesc<bf16[64, 32]>", "m": "i32", "c": "tensordesc<fp32[64, 16]>", "p": "*i32",
                 "K": "constexpr"}
    desc = lambda t: types.SimpleNamespace(base=t, shape=list(t.shape), strides=list(t.stride()), padding="zero")
    args = [desc(a), 64, desc(c), "ptr", 16]
    descs = {0: (a.data_ptr(), (64, 48), (48, 1)), 2: (c.data_ptr(), (64, 32), (32, 1))}
    theirs, ours = _triton_and_ours([meta_a, meta_c], signature, args, descs)
    assert ours == theirs
    # a descriptor map is kept per (address, shape, strides, metadata): the second launch reuses it
    assert len(_direct._MAPS) == 2


def test_a_launch_with_other_descriptor_positions_is_refused(fake_driver):
    if not _direct.tma_expansion_known():
        pytest.skip(f"Triton {triton.__version__} expands descriptors its own way: the short path stays off")
    from triton import knobs
    from triton.backends.nvidia import driver

    calls = []
    meta = dict(swizzle=128, elem_size=2, elem_type=10, block_size=[64, 32], fp4_padded=False)
    inner = driver.wrap_handle_tensordesc(lambda *a: calls.append(a), {"a": "tensordesc<bf16[64, 32]>", "m": "i32"},
                                          [meta])
    ours = types.SimpleNamespace(tma=_direct._tma_launcher(inner), knobs=knobs.runtime, function="fn",
                                 head=(False, False, None, None, "packed", None, None, None))
    assert not _direct.launch_tma(ours, (1, 1, 1), 0, [None, 3], {1: (0, (1, 1), (1, 1))})
    assert calls == []


def test_a_launcher_without_descriptors_has_no_short_tma_path():
    assert _direct._tma_launcher(lambda *a: None) is None
