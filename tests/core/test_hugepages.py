"""Host tensors a loader fills ask for huge pages: fewer page faults where Linux offers them, the same tensor."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from core.files.hugepages import HUGE_PAGE, advise_huge_pages
from core.files.skeleton import host_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_a_tensor_advised_holds_what_is_written_and_small_or_meta_ones_are_left_alone():
    tensor = host_empty(torch.Size([3 * HUGE_PAGE + 5]), torch.uint8)
    tensor.copy_(torch.arange(tensor.numel()) % 251)
    assert torch.equal(tensor, (torch.arange(tensor.numel()) % 251).to(torch.uint8))
    advise_huge_pages(torch.empty(10))  # too small: nothing to ask
    advise_huge_pages(torch.empty(4 * HUGE_PAGE, device="meta"))  # no memory: nothing to ask


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="this kernel offers no transparent huge pages"
)
def test_writing_a_large_advised_tensor_takes_far_fewer_page_faults_than_small_pages():
    size = 256 * 1024**2
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    host_empty(torch.Size([size]), torch.uint8).fill_(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < size // 4096 // 4, faults  # 65,536 with 4 KiB pages; a few hundred with 2 MiB ones
