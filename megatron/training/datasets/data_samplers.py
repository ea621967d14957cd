"""Batch samplers and the data-loader factory of the training application (Megatron-LM's `data_samplers.py`).

`MegatronPretrainingSampler` ("single") walks the global sample ids in order from `consumed_samples`, so a resumed
run, or one with a different data-parallel size, sees the same global sequence of samples (the datasets already
shuffle). `MegatronPretrainingRandomSampler` ("cyclic") draws a fresh permutation each epoch, seeded by the epoch.
"""

import signal
from typing import Any, Iterator, List, Optional

import torch

from megatron.core.utils import cuda_available
from megatron.training.error_handling import die_with_parent, launched_by_torchrun

DATALOADER_TYPES = ("single", "cyclic", "external")


def _check_layout(micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int) -> None:
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if data_parallel_size <= 0:
        raise ValueError(f"data_parallel_size must be positive, got {data_parallel_size}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"data_parallel_rank must be in [0, data_parallel_size={data_parallel_size}), got {data_parallel_rank}"
        )


class MegatronPretrainingSampler:
    """Micro-batches of global sample ids `consumed_samples, consumed_samples + 1, ...` for one data-parallel rank.

    The ids are taken `micro_batch_size * data_parallel_size` at a time; rank `r` gets the slice
    `[r * micro_batch_size, (r + 1) * micro_batch_size)` of each chunk. A final incomplete chunk is dropped unless
    `drop_last=False`, in which case each rank gets its (possibly shorter) slice of it, if that slice is not empty.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples must be positive (no sample to consume), got {total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed_samples ({consumed_samples}) must be in [0, total_samples={total_samples}): no samples "
                f"left to consume; build the dataset with more samples (e.g. raise --train-samples or --train-iters)"
            )
        _check_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self):
        start_idx = self.data_parallel_rank * self.micro_batch_size
        return start_idx, start_idx + self.micro_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        start, end = self.get_start_end_idx()
        chunk = self.micro_batch_times_data_parallel_size
        first = self.consumed_samples
        while first + chunk <= self.total_samples:
            yield list(range(first + start, first + end))
            first += chunk
        if first < self.total_samples and not self.drop_last:
            remainder = list(range(first, self.total_samples))[start:end]
            if remainder:
                yield remainder


class MegatronPretrainingRandomSampler:
    """Micro-batches from a per-epoch random permutation (torch.randperm seeded by the epoch number).

    Each epoch covers the largest multiple of `micro_batch_size * data_parallel_size` samples. With
    `data_sharding` each rank permutes its own contiguous bucket of the dataset; without it, one permutation of
    the whole dataset is dealt out round-robin. `consumed_samples` (which must fall on a global-batch boundary)
    picks the epoch and the position inside it, so a resumed run continues the same permutation.
    """

    def __init__(
        self,
        dataset: Any,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
    ) -> None:
        _check_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        chunk = micro_batch_size * data_parallel_size
        if total_samples < chunk:
            raise ValueError(
                f"total_samples ({total_samples}) must be at least micro_batch_size * data_parallel_size ({chunk}) "
                f"for the cyclic sampler"
            )
        if consumed_samples < 0 or consumed_samples % chunk != 0:
            raise ValueError(
                f"consumed_samples ({consumed_samples}) must be a non-negative multiple of micro_batch_size * "
                f"data_parallel_size ({chunk}) for the cyclic sampler"
            )
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = chunk
        self.last_batch_size = total_samples % chunk
        self.epoch = 0

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        generator = torch.Generator()
        generator.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start = self.data_parallel_rank * bucket_size
            permutation = torch.randperm(bucket_size, generator=generator).tolist()
            ids = [start + x for x in permutation[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            permutation = torch.randperm(full_bucket_size, generator=generator).tolist()
            ids = permutation[current_epoch_samples:][self.data_parallel_rank :: self.data_parallel_size]

        for first in range(0, len(ids) - self.micro_batch_size + 1, self.micro_batch_size):
            self.consumed_samples += self.micro_batch_times_data_parallel_size
            yield ids[first : first + self.micro_batch_size]


def build_pretraining_data_loader(
    dataset: Optional[Any],
    consumed_samples: int,
    *,
    dataloader_type: str = "single",
    micro_batch_size: int,
    data_parallel_rank: int = 0,
    data_parallel_size: int = 1,
    num_workers: int = 0,
    drop_last: bool = True,
    data_sharding: bool = True,
):
    """A DataLoader over `dataset` with the sampler `dataloader_type` names (`--dataloader-type`).

    "single": MegatronPretrainingSampler; "cyclic": MegatronPretrainingRandomSampler; "external": the dataset is
    returned as is (it is its own iterator). None for a None dataset.
    """
    if dataloader_type not in DATALOADER_TYPES:
        raise ValueError(
            f"dataloader_type must be one of {DATALOADER_TYPES} (--dataloader-type), got {dataloader_type!r}"
        )
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if dataset is None:
        return None
    if dataloader_type == "external":
        return dataset
    if dataloader_type == "single":
        batch_sampler = MegatronPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size, drop_last
        )
    else:
        batch_sampler = MegatronPretrainingRandomSampler(
            dataset,
            len(dataset),
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
            data_sharding,
        )
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=cuda_available(),
        persistent_workers=num_workers > 0,
        worker_init_fn=ignore_sigterm_in_worker,
    )


def ignore_sigterm_in_worker(worker_id: int) -> None:
    """DataLoader workers of a torchrun job leave SIGTERM to their rank, and every worker dies with its rank.

    Schedulers and torchrun signal every process of a job; a worker that died of it would take its rank down
    before the rank's signal handler (``--exit-signal-handler``) could save a checkpoint and exit cleanly. Since a
    worker then ignores the usual way to stop it, it ends with its rank instead (the kernel's parent-death signal,
    or a watching thread), so a killed rank never leaves workers behind. Outside torchrun nothing signals the
    whole job, and a worker keeps SIGTERM, which is how Python stops it when its process exits.
    """
    if launched_by_torchrun():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
