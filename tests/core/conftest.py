"""Fixtures of the core tests: the small model and its input."""

from __future__ import annotations

import pytest
import torch

from tests.core.small_net import Net


@pytest.fixture
def net() -> Net:
    return Net()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
