"""Marks for tests that need CUDA, so every `gpu` test skips cleanly on a machine without it.

Use `pytestmark = gpu` on a module or test class, or `marks=gpu` in `pytest.param`;
`@pytest.mark.gpu` alone only labels a test, `requires_cuda` is what skips it.
"""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
gpu = [pytest.mark.gpu, requires_cuda]
