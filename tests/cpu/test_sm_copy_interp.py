"""The SM copy kernel of ``tpfuse bench comm`` under TRITON_INTERPRET=1: every word lands, for
grids smaller and larger than the number of blocks and sizes that end mid-block."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed; the interpreter tests need it")


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    sys.modules.pop("tpfuse.kernels.sm_copy", None)  # decorate again, under the interpreter
    yield
    if prev is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = prev
    sys.modules.pop("tpfuse.kernels.sm_copy", None)


@pytest.mark.parametrize("words, num_sms", [(1, 1), (4096, 3), (3 * 4096 + 5, 2), (9000, 16)])
def test_sm_copy_copies_every_word(words, num_sms, monkeypatch):
    from tpfuse.bench import comm

    monkeypatch.setattr(comm, "_SM_BLOCK", 1024)  # a few blocks per program at these sizes
    src = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32)
    dst = torch.full_like(src, -7)
    comm.sm_copy(src, dst, num_sms)
    assert torch.equal(dst, src)


def test_sm_copy_checks_its_operands():
    from tpfuse.bench import comm

    with pytest.raises(ValueError, match="int32 vectors of one shape"):
        comm.sm_copy(torch.zeros(4, dtype=torch.int32), torch.zeros(5, dtype=torch.int32), 1)
