"""_set_random_seed keeps Megatron-LM 0.19's signature (``seed_`` first, then the tracker switches) and seeds
every generator from the same per-rank seed."""

import inspect
import random

import numpy as np
import pytest
import torch

from megatron.training.initialize import _set_random_seed


def test_signature_matches_megatron():
    names = list(inspect.signature(_set_random_seed).parameters)
    assert names[:5] == [
        "seed_",
        "data_parallel_random_init",
        "te_rng_tracker",
        "inference_rng_tracker",
        "use_cudagraphable_rng",
    ]


def test_same_seed_same_streams_on_one_rank():
    _set_random_seed(seed_=123, data_parallel_random_init=False)
    first = (random.random(), np.random.rand(), torch.rand(3))
    _set_random_seed(123)
    second = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])
    # Rank 0 of every group adds nothing to the seed.
    random.seed(123)
    np.random.seed(123)
    assert (random.random(), np.random.rand()) == first[:2]


def test_non_positive_seed_is_refused():
    with pytest.raises(ValueError, match=r"Seed \(0\) should be a positive integer"):
        _set_random_seed(0)
