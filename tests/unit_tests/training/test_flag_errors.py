"""Config errors reach a command-line user in flag terms (megatron.training.flag_errors), while the library API keeps
its field names."""

import argparse
import re

import pytest

from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_args_list, validate_args
from megatron.training.flag_errors import flag_spellings, in_flag_terms

BASE = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "100",
]


@pytest.fixture
def spellings():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-experts", type=int, dest="num_experts")
    parser.add_argument("--moe-router-topk", type=int)
    parser.add_argument("--moe-token-dispatcher-type", type=str)
    parser.add_argument("--moe-apply-probs-on-input", action="store_true")
    parser.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    parser.add_argument("--save-interval", "--persistent-save-interval", type=int)
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--clip-grad", type=float)
    return flag_spellings(parser, {"num_moe_experts": "num_experts"})


@pytest.mark.parametrize(
    "message, expected",
    [
        (
            "moe_router_topk=5 is larger than num_moe_experts=4; lower moe_router_topk",
            "--moe-router-topk 5 is larger than --num-experts 4; lower --moe-router-topk",
        ),
        ("needs moe_token_dispatcher_type='alltoall' here", "needs --moe-token-dispatcher-type alltoall here"),
        ("moe_apply_probs_on_input=True needs it", "--moe-apply-probs-on-input needs it"),
        ("moe_apply_probs_on_input=False is fine", "without --moe-apply-probs-on-input is fine"),
        ("add_bias_linear=False drops biases", "--disable-bias-linear drops biases"),
        ("unset add_bias_linear", "unset add_bias_linear (--disable-bias-linear)"),
        ("overlap=False, not overlap=True", "--no-overlap, not --overlap"),
        ("got save_interval=7.", "got --save-interval 7."),
        ("OptimizerConfig.clip_grad must be >= 0", "--clip-grad must be >= 0"),
        ("fp16 weights with fp16=True", "fp16 weights with --fp16"),
        ("read /ckpt/num_experts.json and config.num_experts", "read /ckpt/num_experts.json and config.num_experts"),
    ],
)
def test_fields_and_dests_become_the_flags_that_set_them(spellings, message, expected):
    assert in_flag_terms(message, spellings) == expected


def _fails(monkeypatch, flags, world_size=1) -> str:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError) as raised:
        validate_args(parse_args_list(BASE + flags))
    return str(raised.value)


@pytest.mark.parametrize(
    "flags, world_size, expected",
    [
        (
            ["--num-experts", "4", "--moe-router-topk", "5"],
            1,
            "--moe-router-topk 5 is larger than --num-experts 4; each token can use at most every expert once: "
            "lower --moe-router-topk or add experts",
        ),
        (
            ["--num-experts", "4", "--moe-apply-probs-on-input"],
            1,
            "--moe-apply-probs-on-input needs --moe-router-topk 1 (got 2)",
        ),
        (
            ["--num-experts", "4", "--moe-layer-freq", "[1,0]"],
            1,
            "--moe-layer-freq [1, 0] must list 0 (dense) or 1 (MoE) for each of the --num-layers 4 layers",
        ),
        (
            ["--num-experts", "4", "--moe-expert-capacity-factor", "1.0"],
            1,
            "--moe-expert-capacity-factor 1.0 needs --moe-token-dispatcher-type alltoall",
        ),
        (
            ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention"]
            + ["--num-query-groups", "1"],
            2,
            "--cp-comm-type a2a scatters heads over 2 context-parallel ranks, but --num-query-groups 1 gives 1 per "
            "tensor-parallel rank",
        ),
        (
            ["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
            2,
            "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes [a2a size, p2p size] with product "
            "--context-parallel-size 2",
        ),
        (
            ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
            1,
            "--recompute-num-layers must be a positive integer, got 0",
        ),
        (["--clip-grad", "-1"], 1, "--clip-grad must be >= 0 (0 disables clipping), got -1.0"),
    ],
    ids=[
        "moe-topk",
        "moe-probs-on-input",
        "moe-layer-freq",
        "moe-capacity",
        "cp-a2a-heads",
        "cp-a2a-p2p",
        "recompute",
        "clip-grad",
    ],
)
def test_config_errors_from_the_command_line_name_the_flags(monkeypatch, flags, world_size, expected):
    message = _fails(monkeypatch, flags, world_size)
    assert expected in message, message
    assert not re.search(r"\b(moe_router_topk|num_moe_experts|cp_comm_type|recompute_num_layers|clip_grad)\b", message)


def test_the_library_keeps_its_field_names():
    with pytest.raises(ValueError, match=r"moe_router_topk=5 is larger than num_moe_experts=4"):
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4, moe_router_topk=5)
    with pytest.raises(ValueError, match=r"OptimizerConfig.clip_grad must be >= 0"):
        OptimizerConfig(clip_grad=-1.0)


def test_a_message_already_in_flag_terms_is_raised_unchanged(monkeypatch):
    message = _fails(monkeypatch, ["--num-attention-heads", "5"])
    assert (
        message
        == "--hidden-size (64) is not divisible by --num-attention-heads (5); change one of them or set --kv-channels"
    )
