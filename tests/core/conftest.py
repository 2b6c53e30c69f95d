"""Fixtures of the core tests: the small model and its input, and a check after every test that it left no failed
host registration pending (a page registered, then freed without being unregistered, makes a later registration on
it fail: on CUDA, at the next kernel of whatever runs next).

``DEVICE_CONTROL_SIMULATE_PLATFORM=windows`` (or ``linux-64k``, ``macos``) runs the whole tier on that simulated
platform (``core.devices.sim.platforms``): CI runs it under each."""

from __future__ import annotations

import gc

import pytest
import torch

from core.devices.host_memory import platform, use_platform
from core.devices.sim.host import REGISTRY
from core.devices.sim.platforms import platform_from_env
from tests.core.small_net import Net, width

use_platform(platform_from_env())


def pytest_report_header() -> str:
    return f"platform: {platform().name} ({platform().page // 1024} KiB pages)"


@pytest.fixture
def net() -> Net:
    return Net()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(4, width(), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def no_registration_left_failing():
    yield
    gc.collect()
    error = REGISTRY.take_error()
    assert error is None, f"a host registration failed in this test and its error was left pending: {error}"
