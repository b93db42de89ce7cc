"""The precision matrix of tests/e2e/test_precision_matrix.py on a CUDA device, plus nf4."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from difftune import families

from ..e2e.test_precision_matrix import CELLS, check_cell

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
NF4 = list(itertools.product(families.names(), ("fp16", "bf16"), ("nf4",),
                             ("memory", "none"), (False, True)))


@pytest.mark.parametrize("family, mixed, base, text, trained", CELLS + NF4)
def test_cell_on_cuda(tmp_path: Path, family: str, mixed: str, base: str, text: str,
                      trained: bool) -> None:
    pytest.importorskip("bitsandbytes") if base == "nf4" else None
    check_cell(tmp_path, family, mixed, base, text, trained, "cuda")
