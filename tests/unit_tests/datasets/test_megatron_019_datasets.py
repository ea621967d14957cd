"""Megatron-Core 0.19's dataset API: the new config fields (accepted with Megatron's defaults, refused when they ask
for something not built yet), the ambiguous-padding check, IndexedDataset's document indices and constructor
options, BlendedMegatronDatasetBuilder.build_generic_dataset and compile_helpers."""

import logging
import pickle

import numpy as np
import pytest
import torch.distributed as dist

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import compile_helpers
from tests.unit_tests.datasets.corpus import EOD, write_corpus
from tests.unit_tests.datasets.test_gpt_dataset import make_config, make_dataset
from tests.unit_tests.test_utilities import run_distributed


class PadIsEod:
    eod = EOD
    pad = EOD
    unique_identifiers = {"class": "PadIsEod"}


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("multiple_validation_sets", True, "separate validation datasets per blend entry"),
        ("full_validation", True, "validation over the whole validation set"),
    ],
)
def test_blended_config_refuses_what_is_not_built(field, value, match):
    with pytest.raises(ValueError, match=rf"not supported yet: {match} \({field}=True\)"):
        BlendedMegatronDatasetConfig(random_seed=1, sequence_length=8, **{field: value})


def test_blended_config_accepts_megatron_defaults_and_no_effect_knobs():
    config = BlendedMegatronDatasetConfig(
        random_seed=1,
        sequence_length=8,
        multiple_validation_sets=False,
        full_validation=None,
        fast_cache_load=True,
        defer_npy_index_mmap=True,
    )
    assert config.mock and not config.allow_ambiguous_pad_tokens


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("object_storage_cache_path", "/cache", "datasets in object storage"),
        ("hybrid_context_parallel", True, "hybrid context parallelism"),
        ("sequence_parallel_size", 2, "sequence packing for hybrid context parallelism"),
        ("inter_document_masking", True, "inter-document attention masking of packed sequences"),
        ("sequences_per_dataset", {"a": (1, 1)}, "known per-dataset sequence counts"),
        ("token_dtype_code", 8, "a known token dtype for every dataset"),
    ],
)
def test_gpt_config_refuses_what_is_not_built(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=rf"not supported yet: {match} \({field}="):
        make_config(tmp_path, **{field: value})


def test_gpt_config_defaults(tmp_path):
    config = make_config(tmp_path, data_parallel_size=4, context_parallel_size=2)
    assert (config.reset_position_ids, config.reset_attention_mask, config.eod_mask_loss) == (False, False, False)
    assert GPTDatasetConfig.__dataclass_fields__["reset_position_ids"].default is None  # Megatron's default
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer, got 0"):
        make_config(tmp_path, data_parallel_size=0)


def test_a_pad_id_equal_to_eod_pads_with_minus_one_unless_allowed(tmp_path, caplog):
    documents = [[5, 6, EOD], [7, 8, 9, EOD]]
    with caplog.at_level(logging.WARNING):
        dataset = make_dataset(tmp_path, documents, 2, tokenizer=PadIsEod(), sequence_length=4)
    assert "padding id 0 is also its end-of-document id; padding with -1 instead" in caplog.text
    sample = dataset[0]
    assert (sample["labels"] == EOD).any() and all(sample["loss_mask"][sample["labels"] == EOD] == 1)

    (tmp_path / "allowed").mkdir()
    allowed = make_dataset(
        tmp_path / "allowed", documents, 2, tokenizer=PadIsEod(), allow_ambiguous_pad_tokens=True, sequence_length=4
    )
    sample = allowed[0]
    assert all(sample["loss_mask"][sample["labels"] == EOD] == 0)  # the tokenizer's pad id masks EODs out


def _corpus(tmp_path):
    return write_corpus(str(tmp_path / "c"), [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]])


def test_document_indices_can_be_read_and_regrouped(tmp_path):
    dataset = IndexedDataset(_corpus(tmp_path))
    assert dataset.get_document_indices().tolist() == [0, 1, 2, 3, 4]
    dataset.set_document_indices(np.array([0, 2, 4]))
    assert dataset.document_indices.tolist() == [0, 2, 4] and dataset.get_document_indices().tolist() == [0, 2, 4]
    assert dataset[1].tolist() == [4, 5]  # the sequences themselves do not change
    for bad in ([1, 4], [0, 3], [0, 3, 2, 4], [[0, 4]], [0.0, 4.0]):
        with pytest.raises(ValueError, match="document indices must"):
            dataset.set_document_indices(np.array(bad))


def test_indexed_dataset_options(tmp_path):
    prefix = _corpus(tmp_path)
    dataset = IndexedDataset(prefix, False, True, None, None, True)  # fast_cache_load has no effect
    assert len(dataset) == 4 and dataset.get(3, 1, 2).tolist() == [8, 9]
    assert pickle.loads(pickle.dumps(dataset))[0].tolist() == [1, 2, 3]
    dataset.initialize(prefix, False, False, None)  # re-open without mmap
    assert not dataset.mmap and dataset[2].tolist() == [6]
    for kwargs, match in [
        ({"object_storage_config": object()}, "datasets in object storage"),
        ({"s3_config": object()}, "S3 datasets"),
        ({"sequences_per_dataset": (4, 4)}, "a known sequence count instead of the index header"),
        ({"dtype_code": 8}, "a known dtype instead of the index header"),
    ]:
        with pytest.raises(ValueError, match=f"not supported yet: {match}"):
            IndexedDataset(prefix, **kwargs)


def test_build_generic_dataset_on_one_process():
    assert BlendedMegatronDatasetBuilder.build_generic_dataset(list, lambda: True, True, (1, 2)) == [1, 2]
    assert BlendedMegatronDatasetBuilder.build_generic_dataset(list, lambda: False, True, (1, 2)) is None


def _build_generic(tmp_path, fail_on):
    rank = dist.get_rank()
    log = tmp_path / "order.txt"

    def build(name):
        if rank == fail_on:
            raise OSError(f"rank {rank} cannot build {name}")
        with open(log, "a") as f:
            f.write(f"{rank}\n")
        return f"{name} on {rank}"

    try:
        return BlendedMegatronDatasetBuilder.build_generic_dataset(build, lambda: rank != 2, True, "ds")
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def test_build_generic_dataset_builds_on_rank_0_first_and_fails_together(tmp_path):
    results = run_distributed(3, _build_generic, tmp_path, None)
    assert results == ["ds on 0", "ds on 1", None]
    assert (tmp_path / "order.txt").read_text().splitlines() == ["0", "1"]  # rank 1 waited for rank 0
    (tmp_path / "order.txt").unlink()
    results = run_distributed(3, _build_generic, tmp_path, 0)
    assert results[0] == "OSError: rank 0 cannot build ds"
    assert (
        results[1]
        == results[2]
        == ("RuntimeError: global rank 0 failed to build the datasets (see that rank's error); stopping")
    )
    assert not (tmp_path / "order.txt").exists()


def test_compile_helpers_has_nothing_to_build():
    assert compile_helpers() is None
