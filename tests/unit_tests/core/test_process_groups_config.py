"""ProcessGroupCollection: the parallel_state groups, held explicitly (Megatron's field names and semantics)."""

from dataclasses import fields

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import (
    MultiModuleProcessGroupCollection,
    ProcessGroupCollection,
    ProcessGroupHelperMeta,
    tp_group_or_default,
)
from tests.unit_tests.test_utilities import run_distributed

# Field name -> the parallel_state accessor for the same group, in Megatron's field order.
GLOBAL_GROUP_OF = {
    "tp": ps.get_tensor_model_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "mp": ps.get_model_parallel_group,
    "embd": ps.get_embedding_group,
    "pos_embd": ps.get_position_embedding_group,
    "cp": ps.get_context_parallel_group,
    "tp_cp": ps.get_tensor_and_context_parallel_group,
    "hcp": lambda: ps.get_hierarchical_context_parallel_groups(check_initialized=False),
    "ep": ps.get_expert_model_parallel_group,
    "expt_tp": ps.get_expert_tensor_parallel_group,
    "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
    "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group,
    "tp_ep_pp_with_egtp_remat": lambda: ps.get_expert_tensor_model_pipeline_parallel_group(with_egtp_remat=True),
    "tp_dp_cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
    "dp": ps.get_data_parallel_group,
    "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "dp_cp_gtp_remat": lambda: ps.get_data_parallel_group(with_context_parallel=True, with_gtp_remat=True),
    "dp_cp_ag": lambda: None,
    "gtp_remat": lambda: None,
    "expt_gtp_remat": lambda: None,
    "expt_dp": ps.get_expert_data_parallel_group,
    "expt_dp_gtp_remat": lambda: ps.get_expert_data_parallel_group(with_gtp_remat=True),
    "expt_dp_ag": lambda: None,
    "intra_dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
    "intra_expt_dp": lambda: ps.get_expert_data_parallel_group(partial_expert_data_parallel=True),
    "inter_dist_opt": lambda: ps.get_inter_distributed_optimizer_instance_group(check_initialized=False),
    "intra_dist_opt": ps.get_intra_distributed_optimizer_instance_group,
}


def test_field_names_are_megatrons_short_names():
    assert [f.name for f in fields(ProcessGroupCollection)] == list(GLOBAL_GROUP_OF)


def test_unset_groups_read_as_none_like_megatron():
    # Megatron 0.19's ProcessGroupCollection.__getattr__: a declared group that was never set is None.
    collection = ProcessGroupCollection()
    assert all(getattr(collection, name) is None for name in GLOBAL_GROUP_OF)
    assert (collection.cp, collection.dp, collection.dp_cp) == (None, None, None)
    assert repr(collection) == "ProcessGroupCollection(empty)"
    assert vars(collection) == {}  # reading does not set anything
    explicit_none = ProcessGroupCollection(cp=None)
    assert explicit_none.cp is None and repr(explicit_none) == "ProcessGroupCollection(empty)"
    with pytest.raises(AttributeError, match=r"'ProcessGroupCollection' object has no attribute 'tensor'"):
        collection.tensor


def test_unknown_keyword_is_an_error():
    with pytest.raises(ValueError, match=r"Unknown attribute: tensor"):
        ProcessGroupCollection(tensor=None)


def test_unknown_group_name_is_an_error():
    with pytest.raises(ValueError, match=r"Invalid process groups requested: \['tensor'\]; known names are \[.*'tp'"):
        ProcessGroupCollection.use_mpu_process_groups(["tp", "tensor"])


def test_use_mpu_process_groups_before_initialisation_is_an_error():
    ps.destroy_model_parallel()
    not_initialized = r"model parallel groups are not initialized; call initialize_model_parallel\(\) first"
    with pytest.raises(RuntimeError, match=not_initialized):
        ProcessGroupCollection.use_mpu_process_groups()
    with pytest.raises(RuntimeError, match=not_initialized):
        tp_group_or_default(None)


def test_helper_metaclass_refuses_direct_virtual_pipeline_assignment():
    class Helper(metaclass=ProcessGroupHelperMeta):
        virtual_pipeline_model_parallel_size = None

        @classmethod
        def set_virtual_pipeline_model_parallel_size(cls, size):
            type.__setattr__(cls, "virtual_pipeline_model_parallel_size", size)

    with pytest.raises(AttributeError, match=r"Cannot set 'virtual_pipeline_model_parallel_size' directly"):
        Helper.virtual_pipeline_model_parallel_size = 2
    Helper.set_virtual_pipeline_model_parallel_size(2)
    Helper.other = 3  # other class attributes are unaffected
    assert (Helper.virtual_pipeline_model_parallel_size, Helper.other) == (2, 3)


def test_multi_module_collection_validates_its_modules():
    language, vision = ProcessGroupCollection(tp=None), ProcessGroupCollection(tp=None)
    both = MultiModuleProcessGroupCollection({"language": language, "vision": vision}, "language")
    assert both.module_pgs["vision"] is vision and both.language_model_module_name == "language"
    assert MultiModuleProcessGroupCollection({"language": language}).language_model_module_name is None
    with pytest.raises(ValueError, match=r"language_model_module_name='text' is not one of the modules"):
        MultiModuleProcessGroupCollection({"language": language}, "text")
    with pytest.raises(ValueError, match=r"module_pgs\['vision'\] is a dict; every value must be a ProcessGroupColl"):
        MultiModuleProcessGroupCollection({"vision": {}})
    with pytest.raises(ValueError, match=r"needs at least one module"):
        MultiModuleProcessGroupCollection({})


def _collections_from_the_globals():
    """Rank function on 8 ranks with tp=2, pp=4 and ep=2: every field, a subset, and the tp fallback."""
    ps.initialize_model_parallel(2, 4, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    everything = ProcessGroupCollection.use_mpu_process_groups()
    subset = ProcessGroupCollection.use_mpu_process_groups(["pp", "tp"])
    tp_sum = torch.tensor([dist.get_rank()])
    dist.all_reduce(tp_sum, group=everything.tp)  # the collection's groups are the working communicators
    return {
        "everything_is_global": {name: getattr(everything, name) is get() for name, get in GLOBAL_GROUP_OF.items()},
        "subset_is_global": (
            subset.tp is ps.get_tensor_model_parallel_group(),
            subset.pp is ps.get_pipeline_model_parallel_group(),
        ),
        "subset_others_absent": set(vars(subset)) == {"tp", "pp"}
        and all(getattr(subset, n) is None for n in GLOBAL_GROUP_OF if n not in ("tp", "pp")),
        "subset_repr": repr(subset),
        "embd_present": everything.embd is not None,
        "intra_dist_opt_size": everything.intra_dist_opt.size(),
        "tp_sum": int(tp_sum.item()),
        "default_tp": tp_group_or_default(None) is ps.get_tensor_model_parallel_group(),
        "empty_falls_back": tp_group_or_default(ProcessGroupCollection()) is ps.get_tensor_model_parallel_group(),
        "explicit_tp_wins": tp_group_or_default(ProcessGroupCollection(tp=everything.pp)) is everything.pp,
    }


def test_use_mpu_process_groups_on_real_ranks():
    results = run_distributed(8, _collections_from_the_globals)
    for rank, result in enumerate(results):
        assert result["everything_is_global"] == {name: True for name in GLOBAL_GROUP_OF}, f"rank {rank}"
        assert result["subset_is_global"] == (True, True)
        assert result["subset_others_absent"]
        assert result["subset_repr"] == "ProcessGroupCollection(tp(2), pp(4))"  # Megatron's field order
        # tp=2, pp=4 on 8 ranks: the pipeline is ranks r % 2, r % 2 + 2, ...; only its ends hold the embedding.
        assert result["embd_present"] == (rank // 2 in (0, 3))
        assert result["intra_dist_opt_size"] == 8  # one optimizer instance spans the world
        assert result["tp_sum"] == (rank // 2) * 4 + 1
        assert (result["default_tp"], result["empty_falls_back"], result["explicit_tp_wins"]) == (True, True, True)
