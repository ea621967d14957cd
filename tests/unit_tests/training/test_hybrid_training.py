"""The training side of hybrid models: the pattern flags (and their deprecated spellings) in validate_args, every
error they give, the flags' mapping into the config, Megatron's hybrid FLOPs formula, parameter counts of the
theoretical-memory estimator and the layout report against built models."""

from types import SimpleNamespace

import pytest
import torch

from megatron.training.argument_utils import core_transformer_config_from_args
from megatron.training.flops import num_floating_point_operations
from megatron.training.hybrid_accounting import (
    hybrid_floating_point_operations,
    mamba_layer_forward_flops,
    moe_layer_forward_flops,
)
from megatron.training.layout_report import describe_parallel_layout_for_args, parallel_layout, stage_parameter_counts
from megatron.training.theoretical_memory_usage import count_parameters, report_theoretical_memory
from tests.unit_tests.test_utilities import run_distributed
from tests.unit_tests.training.test_arguments import BASE, validated, without

NO_LAYERS = without("--num-layers")
MAMBA = ["--mamba-state-dim", "8", "--mamba-head-dim", "16", "--mamba-num-groups", "2"]


def hybrid(*extra, **kwargs):
    return validated(*MAMBA, *extra, base=kwargs.pop("base", NO_LAYERS), **kwargs)


# ---- validate_args ------------------------------------------------------------------------------------------------


def test_the_pattern_sets_num_layers_and_marks_the_model_hybrid():
    args = hybrid("--hybrid-layer-pattern", "M*-M-")
    assert (args.num_layers, args.encoder_num_layers, args.is_hybrid_model) == (5, 5, True)
    assert hybrid("--hybrid-layer-pattern", "M*-M", base=BASE).num_layers == 4  # a matching --num-layers is fine
    assert validated().is_hybrid_model is False  # GPT runs are untouched


def test_is_hybrid_model_without_a_pattern_is_all_mamba():
    assert hybrid("--is-hybrid-model", base=BASE).hybrid_layer_pattern == "MMMM"


def test_deprecated_override_pattern_warns_and_becomes_the_pattern():
    with pytest.warns(UserWarning, match="--hybrid-override-pattern has been deprecated. Use --hybrid-layer-pattern"):
        args = hybrid("--hybrid-override-pattern", "M*M-")
    assert (args.hybrid_layer_pattern, args.hybrid_override_pattern, args.num_layers) == ("M*M-", None, 4)


def test_deprecated_ratios_warn_and_make_the_pattern():
    with pytest.warns(UserWarning, match="--hybrid-attention-ratio and --hybrid-mlp-ratio have been deprecated"):
        args = hybrid("--num-layers", "8", "--hybrid-attention-ratio", "0.25")
    assert args.hybrid_layer_pattern == "MM*MM*MM" and args.hybrid_attention_ratio == 0.0


@pytest.mark.parametrize(
    "extra, base, message",
    [
        (
            ["--hybrid-layer-pattern", "M*-M-"],
            BASE,
            "--num-layers (4) does not match the 5 layers of --hybrid-layer-pattern 'M*-M-'; leave --num-layers out",
        ),
        (
            ["--hybrid-layer-pattern", "M*", "--hybrid-override-pattern", "M*"],
            NO_LAYERS,
            "--hybrid-override-pattern and --hybrid-layer-pattern cannot both be given",
        ),
        (
            ["--hybrid-layer-pattern", "M*", "--hybrid-mlp-ratio", "0.5"],
            NO_LAYERS,
            "--hybrid-layer-pattern cannot be used together with --hybrid-attention-ratio or --hybrid-mlp-ratio",
        ),
        (
            ["--hybrid-attention-ratio", "0.5"],
            NO_LAYERS,
            "--hybrid-attention-ratio / --hybrid-mlp-ratio need --num-layers",
        ),
        (
            ["--hybrid-attention-ratio", "0.6", "--hybrid-mlp-ratio", "0.6"],
            BASE,
            "--hybrid-attention-ratio (0.6) + --hybrid-mlp-ratio (0.6) must be at most 1",
        ),
        (["--is-hybrid-model"], NO_LAYERS, "a hybrid model needs --hybrid-layer-pattern (or --num-layers"),
        (
            ["--hybrid-layer-pattern", "M*EM"],
            NO_LAYERS,
            "--hybrid-layer-pattern 'M*EM' has MoE layers ('E') but --num-experts is not set; pass --num-experts",
        ),
        (["--hybrid-layer-pattern", "M*GM"], NO_LAYERS, "not supported yet: Gated DeltaNet layers ('G')"),
        (["--hybrid-layer-pattern", "M*Q"], NO_LAYERS, "'Q' at position 2 is not a layer symbol"),
        (
            ["--hybrid-layer-pattern", "M*-|M-"],
            NO_LAYERS,
            "has 2 '|'-separated pipeline segments but --pipeline-model-parallel-size is 1",
        ),
        (
            ["--hybrid-layer-pattern", "M*|-|M-", "--pipeline-model-parallel-size", "2"],
            NO_LAYERS,
            "has 3 '|'-separated segments, not divisible by --pipeline-model-parallel-size (2)",
        ),
        (
            [
                "--hybrid-layer-pattern",
                "M*|M-",
                "--pipeline-model-parallel-size",
                "2",
                "--decoder-first-pipeline-num-layers",
                "1",
            ],
            NO_LAYERS,
            "do not also give --decoder-first-pipeline-num-layers",
        ),
        (
            [
                "--hybrid-layer-pattern",
                "M*|M-|M-|M*",
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers-per-virtual-pipeline-stage",
                "1",
            ],
            NO_LAYERS,
            "do not also give\n--num-layers-per-virtual-pipeline-stage".replace("\n", " "),
        ),
        (
            [
                "--hybrid-layer-pattern",
                "M*|M-|M-|M*",
                "--pipeline-model-parallel-size",
                "2",
                "--num-virtual-stages-per-pipeline-rank",
                "4",
            ],
            NO_LAYERS,
            "--num-virtual-stages-per-pipeline-rank (4) does not match --hybrid-layer-pattern",
        ),
        (
            [
                "--hybrid-layer-pattern",
                "M*M-",
                "--pipeline-model-parallel-size",
                "2",
                "--num-virtual-stages-per-pipeline-rank",
                "2",
            ],
            NO_LAYERS,
            "virtual pipeline stages of a hybrid model are set by '|' in --hybrid-layer-pattern",
        ),
        (
            ["--hybrid-layer-pattern", "M*|M-", "--pipeline-model-parallel-size", "2"]
            + ["--pipeline-model-parallel-layout", "EMM|MML"],
            NO_LAYERS,
            "--pipeline-model-parallel-layout places GPT layers; a hybrid model's pipeline stages come from '|' in",
        ),
        (
            ["--hybrid-layer-pattern", "M*M-", "--recompute-granularity", "full", "--recompute-method", "uniform"],
            NO_LAYERS,
            "not supported yet: --recompute-granularity full for hybrid models",
        ),
    ],
)
def test_bad_hybrid_flags_are_refused(extra, base, message):
    world_size = 2 if "--pipeline-model-parallel-size" in extra else 1
    with pytest.raises(ValueError) as raised:
        hybrid(*extra, base=base, world_size=world_size)
    assert message in str(raised.value)


def test_pipes_set_the_pipeline_split():
    # 3 + 2 layers: an uneven split no --decoder-first/last flag could express for an even pipeline
    args = hybrid("--hybrid-layer-pattern", "M*-|M-", "--pipeline-model-parallel-size", "2", world_size=2)
    assert args.virtual_pipeline_model_parallel_size is None
    args = hybrid("--hybrid-layer-pattern", "M*|M-|M-|M*", "--pipeline-model-parallel-size", "2", world_size=2)
    assert (args.num_virtual_stages_per_pipeline_rank, args.virtual_pipeline_model_parallel_size) == (2, 2)


def test_mamba_flags_reach_the_config():
    args = hybrid("--hybrid-layer-pattern", "M*", "--mamba-num-heads", "8", "--mamba-training-ssm-states-dtype", "bf16")
    config = core_transformer_config_from_args(args)
    assert (
        config.is_hybrid_model,
        config.mamba_state_dim,
        config.mamba_head_dim,
        config.mamba_num_groups,
        config.mamba_num_heads,
        config.mamba_training_ssm_states_dtype,
    ) == (True, 8, 16, 2, 8, torch.bfloat16)


def test_mamba_inference_dtype_flags_have_no_effect_and_say_so():
    with pytest.warns(UserWarning, match="--mamba-inference-ssm-states-dtype fp32 has no effect here"):
        hybrid("--hybrid-layer-pattern", "M*", "--mamba-inference-ssm-states-dtype", "fp32")


# ---- FLOPs --------------------------------------------------------------------------------------------------------


def _flops_args(pattern, **overrides):
    args = dict(
        hybrid_layer_pattern=pattern,
        num_layers=len(pattern or ""),
        hidden_size=4096,
        ffn_hidden_size=21504,
        num_attention_heads=32,
        kv_channels=128,
        group_query_attention=True,
        num_query_groups=8,
        seq_length=4096,
        swiglu=False,
        padded_vocab_size=256000,
        mamba_state_dim=128,
        mamba_head_dim=64,
        mamba_num_groups=8,
        mamba_num_heads=None,
        num_experts=None,
    )
    args.update(overrides)
    return SimpleNamespace(**args)


def test_attention_and_mlp_layers_count_what_a_transformer_layer_counts():
    # "*-" is one GPT layer split in two; both formulas count the causal half of the scores.
    hybrid_args = _flops_args("*-")
    gpt_args = _flops_args(None, num_layers=1)
    assert hybrid_floating_point_operations(hybrid_args, 2) == pytest.approx(num_floating_point_operations(gpt_args, 2))
    assert num_floating_point_operations(hybrid_args, 2) == hybrid_floating_point_operations(hybrid_args, 2)
    assert hybrid_floating_point_operations(hybrid_args, 2, causal_attention=False) > (
        hybrid_floating_point_operations(hybrid_args, 2)
    )


def test_mamba_layer_flops_follow_megatrons_formula():
    args = _flops_args("M")
    tokens, h, d, n, g = 4096, 4096, 8192, 128, 8
    heads = d // 64
    expected = 2 * tokens * h * (2 * d + 2 * g * n + heads) + 7 * tokens * d * n + 2 * tokens * d * h
    assert mamba_layer_forward_flops(args, 1) == expected
    assert hybrid_floating_point_operations(args, 1) == 3 * (expected + 2 * tokens * h * 256000)
    assert mamba_layer_forward_flops(_flops_args("M", mamba_num_heads=64), 1) == (
        expected - 2 * tokens * h * (heads - 64)  # --mamba-num-heads replaces d / head_dim in in_proj only
    )


def test_moe_layers_count_what_a_gpt_moe_layer_counts():
    # "*E" is one GPT MoE layer split in two (top-2 of 4 experts of width 1024, a shared expert of 2048, SwiGLU).
    moe = dict(
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=1024,
        moe_shared_expert_intermediate_size=2048,
        swiglu=True,
        moe_layer_freq=1,
    )
    hybrid_args = _flops_args("*E", **moe)
    gpt_args = _flops_args(None, num_layers=1, **moe)
    assert hybrid_floating_point_operations(hybrid_args, 2) == pytest.approx(num_floating_point_operations(gpt_args, 2))
    assert moe_layer_forward_flops(hybrid_args, 1) == 4 * 4096 * 4096 * (2 * 1024 + 2048) * 1.5


def test_the_8b_hybrid_per_token():
    from tests.unit_tests.models.hybrid.test_hybrid_layer_allocation import PATTERN_8B

    per_token = hybrid_floating_point_operations(_flops_args(PATTERN_8B), 1) / 4096
    # 24 Mamba + 4 attention + 28 MLP layers of the 8B model: about 6 x 8B parameters per token plus the scan
    # and attention scores.
    assert 45e9 < per_token < 65e9


# ---- parameter counts against built models ------------------------------------------------------------------------


def _model_args(tp: int, pattern: str, ep: int = 1):
    pp = 2 if "|" in pattern else 1
    moe = []
    if "E" in pattern:  # sequence parallelism, as training MoE at TP > 1 needs
        moe = [
            "--num-experts",
            "4",
            "--moe-ffn-hidden-size",
            "32",
            "--moe-shared-expert-intermediate-size",
            "48",
            "--expert-model-parallel-size",
            str(ep),
        ] + (["--sequence-parallel"] if tp > 1 else [])
    return hybrid(
        "--hybrid-layer-pattern",
        pattern,
        *moe,
        "--normalization",
        "RMSNorm",
        "--squared-relu",
        "--disable-bias-linear",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--ffn-hidden-size",
        "96",
        "--position-embedding-type",
        "none",
        "--untie-embeddings-and-output-weights",
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
        world_size=tp * pp * ep,
    )


def _built_stage_parameters(tp: int, pattern: str, ep: int = 1):
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    args = _model_args(tp, pattern, ep)
    args.padded_vocab_size = 128
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(tp, args.pipeline_model_parallel_size, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(1)
    pp_rank, pp = parallel_state.get_pipeline_model_parallel_rank(), args.pipeline_model_parallel_size
    model = HybridModel(
        core_transformer_config_from_args(args),
        hybrid_stack_spec,
        vocab_size=128,
        max_sequence_length=32,
        hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
    )
    return pp_rank, sum(param.numel() for param in model.parameters())


@pytest.mark.parametrize(
    "tp, pattern, ep", [(1, "M*-M-", 1), (2, "M*-M-", 1), (1, "M*-|M-", 1), (1, "ME*-E", 2), (2, "M*E-", 2)]
)
def test_stage_parameter_counts_are_the_built_models(tp, pattern, ep):
    args = _model_args(tp, pattern, ep)
    args.padded_vocab_size = 128
    layout = parallel_layout(
        args.world_size,
        tp,
        args.pipeline_model_parallel_size,
        1,
        ep,
        None,
        "tp-cp-ep-dp-pp",
        args.num_layers,
        hybrid_layer_pattern=pattern,
    )
    counts = stage_parameter_counts(args, layout)
    for pp_rank, per_rank in run_distributed(args.world_size, _built_stage_parameters, tp, pattern, ep):
        assert counts[pp_rank][1] == per_rank
    if "|" not in pattern:
        # the estimator's block + embeddings are the whole model (it leaves out only linear biases: none here)
        parameters = count_parameters(args)
        assert parameters.transformer_block + parameters.embedding_layers == counts[0][0]


def test_layout_report_lists_each_stages_layer_kinds():
    args = _model_args(1, "M*-|M-")
    args.padded_vocab_size = 128
    report = describe_parallel_layout_for_args(args)
    assert "stage 0 on ranks [0]\n    layers 0-2 (M*-) + embedding" in report
    assert "stage 1 on ranks [1]\n    layers 3-4 (M-) + final norm + output layer" in report


def test_theoretical_memory_of_a_hybrid(capsys):
    args = _model_args(1, "M*-M-")
    args.padded_vocab_size = 128
    weights, activations, total = report_theoretical_memory(args, verbose=True)
    assert weights == pytest.approx(count_parameters(args).transformer_block * 18 / 2**20 + 2 * 64 * 128 * 18 / 2**20)
    assert activations > 0 and total == pytest.approx(weights + activations)


# ---- the entry points' model providers ----------------------------------------------------------------------------


def _provided_models():
    import pretrain_hybrid
    import pretrain_mamba
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training.global_vars import set_args, unset_global_variables

    parallel_state.initialize_model_parallel()
    models = {}
    for name, module, spec in (
        ("hybrid", pretrain_hybrid, None),
        ("mamba", pretrain_mamba, None),
        ("hybrid --spec", pretrain_hybrid, ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]),
    ):
        args = _model_args(1, "M*-M-")
        args.padded_vocab_size, args.spec = 128, spec
        unset_global_variables()
        set_args(args)
        model_parallel_cuda_manual_seed(1)
        model = module.model_provider(pre_process=True, post_process=True)
        models[name] = (
            type(model) is MambaModel,
            isinstance(model, HybridModel),
            "".join(model.decoder.layer_type_list),
            sum(p.numel() for p in model.parameters()),
        )
    args.spec = ["only-a-module"]
    try:
        pretrain_hybrid.stack_spec_from_args(args, None)
    except ValueError as error:
        models["bad spec"] = str(error)
    return models


def test_pretrain_hybrid_and_pretrain_mamba_build_the_model_of_the_flags():
    models = run_distributed(1, _provided_models)[0]
    assert models["hybrid"][1:3] == (True, "M*-M-") and not models["hybrid"][0]
    assert models["mamba"][:3] == (True, True, "M*-M-") and models["mamba"][3] == models["hybrid"][3]
    assert models["hybrid --spec"] == models["hybrid"]
    assert models["bad spec"] == "--spec takes a module and the name of a stack spec in it, got 'only-a-module'"


def test_memory_tool_reports_the_8b_hybrid_from_the_command_line(monkeypatch, capsys):
    from tests.unit_tests.models.hybrid.test_hybrid_layer_allocation import PATTERN_8B
    from tests.unit_tests.training.test_theoretical_memory_usage import load_tool

    flags = (
        f"--hybrid-layer-pattern {PATTERN_8B} --hidden-size 4096 --num-attention-heads 32 "
        "--group-query-attention --num-query-groups 8 --seq-length 4096 --micro-batch-size 1 "
        "--tensor-model-parallel-size 4 --world-size 8 --sequence-parallel --recompute-activations "
        "--use-distributed-optimizer --normalization RMSNorm --disable-bias-linear "
        "--untie-embeddings-and-output-weights --position-embedding-type none --tokenizer-type NullTokenizer "
        "--vocab-size 255999"
    ).split()
    monkeypatch.setattr("sys.argv", ["report_theoretical_memory.py"] + flags)
    load_tool().main()  # reads sys.argv
    out = capsys.readouterr().out
    assert "Total number of parameters in billions: 8.65" in out  # 6.56 in the layers, 2 x 4096 x 256000 embeddings
    for kind in ("Mamba", "attention", "MLP"):
        assert f"Activation memory footprint per {kind} layer: " in out
    assert "per transformer layer" not in out


def test_theoretical_memory_of_a_moe_hybrid(capsys):
    args = _model_args(1, "ME*-E", ep=2)
    args.padded_vocab_size = 128
    weights, activations, total = report_theoretical_memory(args, verbose=True)
    counts = count_parameters(args)
    assert counts.num_moe_layers == 2 and counts.routed_experts == 4 * 2 * 64 * 32  # 4 experts, fc1 + fc2, no GLU
    assert counts.active_transformer_block == counts.transformer_block - 2 * 2 * 2 * 64 * 32  # top-2 of 4
    assert "Activation memory footprint per MoE layer" in capsys.readouterr().out
    assert activations > 0 and total == pytest.approx(weights + activations)
