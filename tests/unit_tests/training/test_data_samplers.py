"""Samplers: global order independent of the data-parallel size, resume from consumed_samples, the cyclic sampler,
the data-loader factory and every argument error."""

import pytest
import torch

from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)


def global_order(total, consumed, micro_batch_size, data_parallel_size, drop_last=True):
    """Sample ids in the order the whole data-parallel group consumes them (step by step, rank by rank)."""
    per_rank = [
        list(MegatronPretrainingSampler(total, consumed, micro_batch_size, rank, data_parallel_size, drop_last))
        for rank in range(data_parallel_size)
    ]
    order = []
    for step in range(max(len(batches) for batches in per_rank)):
        for batches in per_rank:
            if step < len(batches):
                order += batches[step]
    return order


def test_rank_takes_its_slice_of_each_global_chunk():
    batches = list(MegatronPretrainingSampler(20, 0, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=3))
    assert batches == [[2, 3], [8, 9], [14, 15]]
    assert len(MegatronPretrainingSampler(20, 0, 2, 1, 3)) == 20


@pytest.mark.parametrize("micro_batch_size, data_parallel_size", [(1, 1), (2, 1), (1, 4), (2, 2), (4, 2), (1, 8)])
def test_global_order_does_not_depend_on_the_data_parallel_layout(micro_batch_size, data_parallel_size):
    assert global_order(64, 0, micro_batch_size, data_parallel_size) == list(range(64))


@pytest.mark.parametrize("consumed", [0, 8, 24])
def test_resume_continues_where_the_run_stopped(consumed):
    full = global_order(64, 0, 2, 4)
    assert global_order(64, consumed, 2, 4) == full[consumed:]
    # Resuming with another layout (8 consumed = one global batch of either) sees the same samples next.
    assert global_order(64, consumed, 4, 2) == full[consumed:]


def test_partial_last_chunk_is_dropped_unless_asked():
    assert global_order(10, 0, 2, 2) == list(range(8))
    assert global_order(11, 0, 2, 2, drop_last=False) == list(range(11))
    last = list(MegatronPretrainingSampler(11, 0, 2, 1, 2, drop_last=False))[-1]
    assert last == [10]
    assert list(MegatronPretrainingSampler(9, 0, 2, 1, 2, drop_last=False))[-1] == [6, 7]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 0, 1, 0, 1), r"total_samples must be positive \(no sample to consume\), got 0"),
        ((10, 10, 1, 0, 1), r"consumed_samples \(10\) must be in \[0, total_samples=10\): no samples left"),
        ((10, -1, 1, 0, 1), r"consumed_samples \(-1\) must be in \[0, total_samples=10\)"),
        ((10, 0, 0, 0, 1), r"micro_batch_size must be positive, got 0"),
        ((10, 0, 1, 0, 0), r"data_parallel_size must be positive, got 0"),
        ((10, 0, 1, 2, 2), r"data_parallel_rank must be in \[0, data_parallel_size=2\), got 2"),
    ],
)
def test_pretraining_sampler_errors(args, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingSampler(*args)


def random_epoch(total, consumed, micro_batch_size, data_parallel_size, data_sharding):
    return [
        list(
            MegatronPretrainingRandomSampler(
                None, total, consumed, micro_batch_size, rank, data_parallel_size, data_sharding
            )
        )
        for rank in range(data_parallel_size)
    ]


@pytest.mark.parametrize("data_sharding", [True, False])
def test_random_sampler_covers_each_epoch_once(data_sharding):
    batches = random_epoch(26, 0, 3, 2, data_sharding)
    ids = [i for rank in batches for batch in rank for i in batch]
    assert all(len(batch) == 3 for rank in batches for batch in rank)
    assert len(ids) == len(set(ids)) == 24 and max(ids) < 26
    assert ids != sorted(ids)


def test_random_sampler_shards_by_rank_and_is_seeded_by_epoch():
    rank_0, rank_1 = random_epoch(24, 0, 3, 2, True)
    assert {i for batch in rank_0 for i in batch} == set(range(12))
    assert {i for batch in rank_1 for i in batch} == set(range(12, 24))
    expected = torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()
    assert [i for batch in rank_0 for i in batch] == expected
    epoch_1 = random_epoch(24, 24, 3, 2, True)[0]
    expected = torch.randperm(12, generator=torch.Generator().manual_seed(1)).tolist()
    assert [i for batch in epoch_1 for i in batch] == expected


@pytest.mark.parametrize("data_sharding", [True, False])
def test_random_sampler_resumes_mid_epoch(data_sharding):
    full = random_epoch(24, 0, 3, 2, data_sharding)
    resumed = random_epoch(24, 12, 3, 2, data_sharding)
    assert resumed == [rank[2:] for rank in full]


def test_random_sampler_counts_consumed_samples():
    sampler = MegatronPretrainingRandomSampler(None, 24, 0, 3, 0, 2)
    batches = list(sampler)
    assert sampler.consumed_samples == 6 * len(batches) == 24


@pytest.mark.parametrize(
    "args, message",
    [
        ((5, 0, 3, 0, 2), r"total_samples \(5\) must be at least micro_batch_size \* data_parallel_size \(6\)"),
        ((24, 4, 3, 0, 2), r"consumed_samples \(4\) must be a non-negative multiple of micro_batch_size \* "),
        ((24, 0, 3, -1, 2), r"data_parallel_rank must be in \[0, data_parallel_size=2\), got -1"),
    ],
)
def test_random_sampler_errors(args, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingRandomSampler(None, *args)


class SquaresDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, idx):
        return {"tokens": torch.tensor([idx, idx * idx])}


def test_data_loader_batches_a_rank_s_samples():
    loader = build_pretraining_data_loader(
        SquaresDataset(), 4, micro_batch_size=2, data_parallel_rank=1, data_parallel_size=2
    )
    batches = [batch["tokens"][:, 0].tolist() for batch in loader]
    assert batches == [[6, 7]]
    cyclic = build_pretraining_data_loader(SquaresDataset(), 0, dataloader_type="cyclic", micro_batch_size=5)
    assert sorted(i for batch in cyclic for i in batch["tokens"][:, 0].tolist()) == list(range(10))


def test_data_loader_special_cases_and_errors():
    dataset = SquaresDataset()
    assert build_pretraining_data_loader(None, 0, micro_batch_size=1) is None
    assert build_pretraining_data_loader(dataset, 0, dataloader_type="external", micro_batch_size=1) is dataset
    with pytest.raises(
        ValueError,
        match=r"dataloader_type must be one of \('single', 'cyclic', 'external'\) "
        r"\(--dataloader-type\), got 'random'",
    ):
        build_pretraining_data_loader(dataset, 0, dataloader_type="random", micro_batch_size=1)
    with pytest.raises(ValueError, match=r"num_workers must be >= 0, got -1"):
        build_pretraining_data_loader(dataset, 0, micro_batch_size=1, num_workers=-1)


class _SigtermDisposition(torch.utils.data.Dataset):
    """Each sample reports whether SIGTERM is ignored in the process that loads it."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        import signal

        return torch.tensor(int(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN))


def test_loader_workers_of_a_torchrun_job_ignore_sigterm(monkeypatch):
    """A SIGTERM sent to the whole job must reach the rank's handler, not kill its DataLoader workers."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    loader = build_pretraining_data_loader(
        _SigtermDisposition(), 0, micro_batch_size=2, num_workers=1, data_parallel_rank=0, data_parallel_size=1
    )
    assert [batch.tolist() for batch in loader] == [[1, 1], [1, 1]]


def test_loader_workers_outside_torchrun_keep_sigterm(monkeypatch):
    """Nothing signals a whole plain-python job; SIGTERM is how Python stops its workers when the process exits."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    loader = build_pretraining_data_loader(
        _SigtermDisposition(), 0, micro_batch_size=2, num_workers=1, data_parallel_rank=0, data_parallel_size=1
    )
    assert [batch.tolist() for batch in loader] == [[0, 0], [0, 0]]
