"""When a test marked ``gpu`` runs, skips or fails (``tests/conftest.py``): a GPU run cannot pass by skipping the
tests its machine can run, and a one-GPU machine is not failed for lacking a second GPU it was never asked for."""

from __future__ import annotations

import pytest

from tests.conftest import REQUIRE_GPU_ENV, gpu_shortfall, required_gpus


@pytest.mark.parametrize(
    ("needed", "found", "required", "expected"),
    [
        (1, 1, 0, None),
        (1, 1, 1, None),
        (2, 2, 1, None),
        (1, 0, 0, ("needs 1 GPU(s), found 0", False)),  # a developer's machine: skipped
        (1, 0, 1, ("needs 1 GPU(s), found 0", True)),  # a GPU run on a machine without one: failed
        (2, 0, 1, ("needs 2 GPU(s), found 0", True)),  # ... the two-GPU tests too
        (2, 1, 1, ("needs 2 GPU(s), found 1", False)),  # a one-GPU run: the two-GPU tests skip, saying why
        (2, 1, 2, ("needs 2 GPU(s), found 1", True)),  # a run that asked for two GPUs on a machine with one
        (1, 1, 2, None),  # a one-GPU test runs wherever one is
    ],
)
def test_a_gpu_test_runs_skips_or_fails_by_what_the_machine_has_and_the_run_requires(needed, found, required, expected):
    assert gpu_shortfall(needed, found, required) == expected


@pytest.mark.parametrize(
    ("value", "expected"), [(None, 0), ("", 0), ("0", 0), ("1", 1), ("2", 2), ("true", 1), ("no", 0)]
)
def test_the_required_gpus_are_read_from_the_environment(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(REQUIRE_GPU_ENV, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_GPU_ENV, value)
    assert required_gpus() == expected


def test_a_required_count_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv(REQUIRE_GPU_ENV, "some")
    with pytest.raises(pytest.UsageError, match=REQUIRE_GPU_ENV):
        required_gpus()
