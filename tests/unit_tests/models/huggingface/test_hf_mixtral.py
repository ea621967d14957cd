"""Mixtral (MoE) conversion beyond the per-family tests of test_hf_conversion.py (TP1, TP2, PP2, export): expert
parallelism (EP2, TP2 x EP2) and TP2 without sequence parallelism give HF's logits with each expert at its global
index, the converted checkpoint's stored layout and MoE arguments, and what the Mixtral table refuses."""

import argparse
import json
import os
import shutil

import pytest
import torch

from tests.unit_tests.models.huggingface.hf_test_models import (
    CONFIGS,
    VOCAB,
    hf_logits,
    relative_error,
    save_hf_model,
    tokens,
)
from tests.unit_tests.test_utilities import run_distributed

MIXTRAL = {key: value for key, value in CONFIGS["mixtral"].items() if key != "model_type"}


def _convert(hf_dir, out_dir, tp):
    from megatron.core.models.huggingface import save_megatron_checkpoint_from_hf

    return save_megatron_checkpoint_from_hf(hf_dir, out_dir, tp, 1)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    hf_dir = save_hf_model("mixtral", str(root / "hf"))
    megatron_dir = str(root / "megatron")
    run_distributed(1, _convert, hf_dir, megatron_dir, 1)
    return hf_dir, megatron_dir, tokens(), hf_logits(hf_dir, tokens())


def test_routing_margins_are_clear(mixtral):
    """On the test batch every token's k-th and (k+1)-th router probabilities differ by far more than fp32 noise,
    so a parallel layout cannot flip an expert choice (the logits comparisons below are not luck)."""
    import transformers

    hf_dir, _, input_ids, _ = mixtral
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        router_logits = model(input_ids, output_router_logits=True).router_logits
    for logits in router_logits:
        top = torch.softmax(logits, dim=-1).topk(3, dim=-1).values
        assert (top[:, 1] - top[:, 2]).min().item() > 1e-4


def _ep_logits(hf_dir, megatron_dir, input_ids, tp, ep, sequence_parallel=None):
    """(in-memory logits, converted-checkpoint logits, this rank's first local expert fc1 / the HF cat(w1, w3) of
    its global index, that global index) at TP x EP (sequence parallelism: the builder's default unless given)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.huggingface import build_gpt_model_from_hf
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1)
    stage = dict(use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    if sequence_parallel is not None:
        stage["sequence_parallel"] = sequence_parallel
    in_memory = build_gpt_model_from_hf(hf_dir, **stage).eval()
    from_checkpoint = build_gpt_model_from_hf(hf_dir, load_weights=False, **stage).eval()
    state = dist_checkpointing.load(
        {"model": from_checkpoint.sharded_state_dict()}, os.path.join(megatron_dir, "release")
    )
    from_checkpoint.load_state_dict(state["model"])

    def forward(model):
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
        with torch.no_grad():
            output = model(input_ids, positions, None)
        group = ps.get_tensor_model_parallel_group()
        shards = [torch.empty_like(output) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, output.contiguous(), group=group)
        return torch.cat(shards, dim=-1)[..., :VOCAB]

    experts = in_memory.decoder.layers[1].mlp.experts
    index = experts.local_expert_offset
    source = load_file(os.path.join(hf_dir, "model.safetensors"))
    prefix = f"model.layers.1.block_sparse_moe.experts.{index}."
    expected_fc1 = torch.cat([source[prefix + "w1.weight"], source[prefix + "w3.weight"]])
    fc1 = experts.local_experts[0].linear_fc1.weight.detach()
    if tp > 1:  # the [gate; up] halves are each split over expert TP: gather both back
        pieces = [torch.empty_like(fc1) for _ in range(tp)]
        dist.all_gather(pieces, fc1.contiguous(), group=ps.get_expert_tensor_parallel_group())
        gates, ups = zip(*(piece.chunk(2) for piece in pieces))
        fc1 = torch.cat([*gates, *ups])
    return forward(in_memory), forward(from_checkpoint), torch.equal(fc1, expected_fc1), index


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 2)])
def test_expert_parallel_model_gives_hf_logits(mixtral, tp, ep):
    hf_dir, megatron_dir, input_ids, expected = mixtral
    results = run_distributed(tp * ep, _ep_logits, hf_dir, megatron_dir, input_ids, tp, ep)
    assert sorted({index for *_, index in results}) == [0, 2]  # EP rank r holds global experts 2r, 2r + 1
    for in_memory, from_checkpoint, expert_matches, index in results:
        assert expert_matches, f"local expert 0 of the rank holding expert {index} is not HF's expert {index}"
        assert relative_error(in_memory, expected) <= 1e-5
        assert relative_error(from_checkpoint, expected) <= 1e-5


def test_tp2_without_sequence_parallel_gives_hf_logits(mixtral):
    """The checkpoint converted at TP1 loads and evaluates at TP2 without --sequence-parallel, as in Megatron-Core
    (every TP rank then routes the whole sequence; the experts are split over TP)."""
    hf_dir, megatron_dir, input_ids, expected = mixtral
    for in_memory, from_checkpoint, expert_matches, _ in run_distributed(
        2, _ep_logits, hf_dir, megatron_dir, input_ids, 2, 1, False
    ):
        assert expert_matches
        assert relative_error(in_memory, expected) <= 1e-5
        assert relative_error(from_checkpoint, expected) <= 1e-5


def test_converted_checkpoint_stores_experts_and_moe_args(mixtral, tmp_path):
    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.core.dist_checkpointing.strategies.torch import read_dcp_metadata
    from megatron.training.checkpointing import load_args_from_checkpoint

    _, megatron_dir, _, _ = mixtral
    checkpoint = os.path.join(megatron_dir, "release")
    stored = read_dcp_metadata(checkpoint).state_dict_metadata
    assert tuple(stored["decoder.layers.mlp.router.weight"].size) == (2, 4, 32)
    assert tuple(stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (2, 4, 96, 32)
    assert tuple(stored["decoder.layers.mlp.experts.experts.linear_fc2.weight"].size) == (2, 4, 32, 48)
    assert not any(key.startswith("decoder.layers.mlp.linear_fc1.weight") for key in stored)
    args = common_args = load_common_state_dict(checkpoint)["args"]
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 48)
    assert (args.moe_router_score_function, args.moe_router_pre_softmax, args.moe_grouped_gemm) == (
        "softmax",
        False,
        False,
    )
    assert args.moe_aux_loss_coeff == 0.02 and args.moe_token_dispatcher_type == "allgather"
    run_args = argparse.Namespace(
        load=megatron_dir,
        ckpt_step=None,
        num_experts=None,
        moe_router_topk=2,
        moe_ffn_hidden_size=None,
        moe_aux_loss_coeff=0.0,
    )
    load_args_from_checkpoint(run_args)
    assert (run_args.num_experts, run_args.moe_ffn_hidden_size, run_args.moe_aux_loss_coeff) == (4, 48, 0.02)
    assert common_args.hf_vocab_size == VOCAB


# ---- refusals --------------------------------------------------------------------------------------------------------


def _refused(hf_dir, tmp_path, match):
    from megatron.core.models.huggingface import save_megatron_checkpoint_from_hf

    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        save_megatron_checkpoint_from_hf(hf_dir, str(out))
    assert not out.exists(), "nothing may be written before a refusal"


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"sliding_window": 16}, r"MixtralForCausalLM: sliding_window = 16 is not supported"),
        (
            {"router_jitter_noise": 0.1},
            r"MixtralForCausalLM: router_jitter_noise = 0.1 is not supported; Megatron's "
            r"router has no multiplicative jitter",
        ),
        (
            {"num_experts_per_tok": 5},
            r"num_experts_per_tok = 5 is not supported; it must be between 1 and "
            r"num_local_experts \(4\)",
        ),
        ({"num_local_experts": None}, r"MixtralForCausalLM: config.json has no 'num_local_experts'"),
    ],
)
def test_mixtral_config_values_refused(tmp_path, changes, match):
    directory = tmp_path / "config_only"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({**MIXTRAL, **changes}))
    _refused(str(directory), tmp_path, match)


def _with_tensors(mixtral, tmp_path, change):
    from safetensors.torch import load_file, save_file

    directory = str(tmp_path / "hf")
    shutil.copytree(mixtral[0], directory)
    weights = os.path.join(directory, "model.safetensors")
    save_file(change(load_file(weights)), weights)
    return directory


def test_fused_expert_layout_refused(mixtral, tmp_path):
    """transformers 5's in-memory layout (experts fused into [E, ...] tensors), if a writer put it on disk, is not
    read: the per-expert names it replaces are missing, and it is named."""

    def fuse(state):
        for layer in range(2):
            experts = f"model.layers.{layer}.block_sparse_moe.experts."
            state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
                [
                    torch.cat([state.pop(f"{experts}{e}.w1.weight"), state.pop(f"{experts}{e}.w3.weight")])
                    for e in range(4)
                ]
            )
            state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
                [state.pop(f"{experts}{e}.w2.weight") for e in range(4)]
            )
        return state

    _refused(
        _with_tensors(mixtral, tmp_path, fuse),
        tmp_path,
        r"tensors missing from the checkpoint: \['model.layers.0.block_sparse_moe.experts.0.w1.weight'",
    )


def test_extra_expert_refused(mixtral, tmp_path):
    def add(state):
        state["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = torch.zeros(48, 32)
        return state

    _refused(
        _with_tensors(mixtral, tmp_path, add),
        tmp_path,
        r"tensors with no place in the mixtral mapping "
        r"\(nothing is dropped silently\): \['model.layers.0.block_sparse_moe.experts.4.w1.weight'\]",
    )


def _moe_args(**changes):
    args = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=64,
        position_embedding_type="rope",
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        ffn_hidden_size=48,
        num_experts=4,
        moe_router_topk=2,
        hf_vocab_size=VOCAB,
    )
    return argparse.Namespace(**{**args, **changes})


def test_a_trained_moe_checkpoint_exports_as_mixtral():
    from megatron.core.models.huggingface.config import settings_from_checkpoint_args
    from megatron.core.models.huggingface.families import family_for_settings

    settings = settings_from_checkpoint_args(_moe_args(moe_ffn_hidden_size=24))
    assert (settings.num_moe_experts, settings.moe_router_topk, settings.moe_ffn_hidden_size) == (4, 2, 24)
    assert family_for_settings(settings).name == "mixtral"


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True"),
        ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid'"),
        ({"moe_shared_expert_intermediate_size": 16}, "moe_shared_expert_intermediate_size=16"),
    ],
)
def test_moe_checkpoint_args_without_a_mixtral_equivalent_refused(changes, match):
    from megatron.core.models.huggingface import UnsupportedHFModelError
    from megatron.core.models.huggingface.config import settings_from_checkpoint_args

    with pytest.raises(UnsupportedHFModelError, match=f"the checkpoint's model uses {match}, which no supported "):
        settings_from_checkpoint_args(_moe_args(**changes))


def test_a_grouped_gemm_checkpoint_exports_like_a_per_expert_one():
    from megatron.core.models.huggingface.config import settings_from_checkpoint_args

    # Both expert layouts store the same checkpoint keys, so export reads either the same way.
    grouped = settings_from_checkpoint_args(_moe_args(moe_grouped_gemm=True))
    assert grouped == settings_from_checkpoint_args(_moe_args(moe_grouped_gemm=False))
