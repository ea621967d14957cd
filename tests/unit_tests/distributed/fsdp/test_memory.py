"""PeakLiveBytes, the peak-memory measure of benchmarks/bench_fsdp_memory.py: storages created in the region count
from their creation until the last tensor on them is freed, held storages at their current size."""

import torch

from megatron.core.distributed.fsdp.memory import PeakLiveBytes


def test_peak_counts_live_storages_views_and_held_buffers_resized_in_place():
    held = torch.empty(2000)  # 8000 bytes, held before the region
    with PeakLiveBytes([held]) as peak:
        a = torch.empty(1000)
        b = a.view(10, 100)
        del a
        c = torch.empty(500)  # a's storage lives on through its view b: 8000 + 4000 + 2000
        del b
        d = torch.empty(750)  # 8000 + 2000 + 3000
        held.untyped_storage().resize_(0)  # freed in place, as FSDP frees its gathered parameters
        e = torch.empty(2500)  # 0 + 2000 + 3000 + 10000
    assert peak.peak_bytes == 15000
    assert c.numel() + d.numel() + e.numel() == 3750


def test_peak_of_a_backward_pass_includes_its_saved_activations():
    x = torch.randn(64, 64, requires_grad=True)  # 16 KiB held
    with PeakLiveBytes([x]) as peak:
        y = (x @ x).relu()  # the product (saved for relu's backward) and y: 16 KiB each
        y.sum().backward()
    assert peak.peak_bytes >= 3 * 64 * 64 * 4
    assert x.grad is not None
