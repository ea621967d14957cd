"""Saved param groups are matched to the current ones by their whole identifier, not by position or by the four
structural flags alone (two groups that differ only by max_lr used to swap their learning rates on resume)."""

import pytest
import torch

from megatron.core.dist_checkpointing.optimizer import load_torch_optimizer_state
from megatron.core.optimizer import MegatronOptimizer, ParamGroupOverride, param_group_identifier_keys

FLAGS = dict(wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False, is_decoupled_lr=False)


def test_identifier_covers_every_override_and_no_per_step_key():
    assert set(ParamGroupOverride.__annotations__) <= set(param_group_identifier_keys)
    assert {"lr_mult", "is_expert_parallel", "is_decoupled_lr"} <= set(param_group_identifier_keys)
    assert not {"lr", "weight_decay", "step"} & set(param_group_identifier_keys)


def test_groups_differing_only_by_max_lr_keep_their_own_state():
    trunk, head = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.Adam(
        [
            {"params": [trunk], "max_lr": 2e-5, "lr": 2e-5, **FLAGS},
            {"params": [head], "max_lr": 5e-4, "lr": 5e-4, **FLAGS},
        ]
    )
    # Saved in the other order, with the learning rates the scheduler had reached.
    saved = [{"max_lr": 5e-4, "lr": 4e-4, **FLAGS}, {"max_lr": 2e-5, "lr": 1e-5, **FLAGS}]
    load_torch_optimizer_state(optimizer, {}, None, saved)
    assert [group["lr"] for group in optimizer.param_groups] == [1e-5, 4e-4]


def test_changed_override_still_finds_its_group_by_flags():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([{"params": [param], "max_lr": 1e-3, "lr": 1e-3, **FLAGS}])
    load_torch_optimizer_state(optimizer, {}, None, [{"max_lr": 3e-4, "lr": 2e-4, **FLAGS}])
    assert optimizer.param_groups[0]["lr"] == 2e-4


def test_filter_and_reorder_matches_nemo_prefix_and_none_as_missing():
    current = [{"params": [], "min_lr": None, "max_lr": 1e-3, **FLAGS}]
    saved = [{"params": [7], "max_lr": 1e-3, "pre_wd_mult": 1.0, "pre_lr_mult": 1.0, "tag": "saved"}]
    saved[0].update(is_expert_parallel=False, is_decoupled_lr=False)
    (group,) = MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
    assert group["tag"] == "saved" and group["params"] == [7]


def test_filter_and_reorder_names_the_missing_group():
    current = [{"params": [], "max_lr": 1e-3, **FLAGS}]
    saved = [{"params": [], "max_lr": 2e-3, **FLAGS}]
    with pytest.raises(ValueError, match="(?s)Could not find parameter group with key .*Available keys"):
        MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
