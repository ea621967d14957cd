"""tp_comm_overlap: the chunked, asynchronous all-gather / reduce-scatter schedules around the TP linears give the
non-overlapped path's results bitwise (TP2, CPU: GEMM rows are independent and a sum of two partials does not depend
on order), run where they should, and bad settings are refused before any collective."""

import types

import pytest
import torch

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import comm_overlap
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.training.argument_validation_comm_overlap import validate_tp_comm_overlap_args
from tests.unit_tests.models.gpt_test_helpers import batch, build_model
from tests.unit_tests.test_utilities import run_distributed

OVERLAP_CASES = {
    "default": {"tp_comm_overlap": True},
    "rs_dgrad, no bulk, qkv not overlapped": {
        "tp_comm_overlap": True,
        "tp_comm_overlap_rs_dgrad": True,
        "tp_comm_bulk_wgrad": False,
        "tp_comm_bulk_dgrad": False,
        "tp_comm_overlap_disable_qkv": True,
    },
    "bulk overlaps only": {"tp_comm_overlap": True, "tp_comm_overlap_ag": False, "tp_comm_overlap_rs": False},
}


def _count_calls(name, counts):
    original = getattr(comm_overlap, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(comm_overlap, name, counted)
    return original


def _gpt_step(variant, overrides):
    """One forward/backward of the tiny TP2 + SP GPT: this rank's loss, logits and gradient shards, and how many
    times each chunked schedule ran."""
    model = build_model(2, True, variant, config_overrides=overrides)
    tokens, position_ids, labels = batch()
    counts = {}
    originals = {name: _count_calls(name, counts) for name in ("gather_then_gemm", "start_gemm_then_reduce_scatter")}
    try:
        loss = model(tokens, position_ids, None, labels=labels)
        loss.sum().backward()
        with torch.no_grad():
            logits = model(tokens, position_ids, None)
    finally:
        for name, original in originals.items():
            setattr(comm_overlap, name, original)
    layer = model.decoder.layers[0]
    overlapped = {
        name: module.tp_comm_overlap is not None
        for name, module in (
            ("qkv", layer.self_attention.linear_qkv),
            ("proj", layer.self_attention.linear_proj),
            ("fc1", layer.mlp.linear_fc1),
            ("fc2", layer.mlp.linear_fc2),
            ("output_layer", model.output_layer),
        )
    }
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"loss": loss.detach(), "logits": logits, "grads": grads, "counts": counts, "overlapped": overlapped}


def _differences(reference, result):
    """Names whose values are not bitwise equal, with the largest absolute difference."""
    pairs = [("loss", reference["loss"], result["loss"]), ("logits", reference["logits"], result["logits"])]
    pairs += [(f"grad {name}", grad, result["grads"][name]) for name, grad in reference["grads"].items()]
    return {name: (a - b).abs().max().item() for name, a, b in pairs if not torch.equal(a, b)}


def _layer_checks():
    """ColumnParallel/RowParallelLinear alone: 3 rows per rank (3 chunks of one row), biases, gradient-accumulation
    fusion into main_grad; overlapped vs not."""
    results = {}
    for overlap in (False, True):
        config = ModelParallelConfig(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            tp_comm_overlap=overlap,
            gradient_accumulation_fusion=True,
            use_cpu_initialization=True,
        )
        torch.manual_seed(3)
        init = torch.nn.init.normal_
        fc1 = ColumnParallelLinear(8, 12, config=config, init_method=init, tp_comm_buffer_name="fc1")
        fc2 = RowParallelLinear(
            12,
            8,
            config=config,
            init_method=init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_comm_buffer_name="fc2",
        )
        for weight in (fc1.weight, fc2.weight):
            weight.main_grad = torch.zeros_like(weight)
        generator = torch.Generator().manual_seed(5 + torch.distributed.get_rank())
        x = torch.randn(3, 2, 8, generator=generator, requires_grad=True)
        hidden, _ = fc1(x)
        out, _ = fc2(torch.tanh(hidden))
        (out * torch.randn(out.shape, generator=generator)).sum().backward()
        results[overlap] = [out.detach(), x.grad, fc1.weight.main_grad, fc2.weight.main_grad, fc1.bias.grad]
        results[f"{overlap} grads are placeholders"] = bool(fc1.weight.grad.abs().sum() == 0)
    return results


def _run_all():
    torch.manual_seed(0)
    results = {"layers": _layer_checks()}
    for variant in ("gpt2", "llama"):
        reference = _gpt_step(variant, {})
        results[variant] = {"reference overlapped": reference["overlapped"]}
        for case, overrides in OVERLAP_CASES.items():
            result = _gpt_step(variant, overrides)
            results[variant][case] = {
                "differences": _differences(reference, result),
                "counts": result["counts"],
                "overlapped": result["overlapped"],
            }
    return results


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(2, _run_all)


def test_overlapped_gpt_equals_plain_gpt_bitwise(tp2_results):
    for rank, results in enumerate(tp2_results):
        for variant in ("gpt2", "llama"):
            for case in OVERLAP_CASES:
                differences = results[variant][case]["differences"]
                assert differences == {}, f"rank {rank} {variant} {case}: not bitwise equal: {differences}"


def test_overlap_runs_in_the_transformer_linears_only(tp2_results):
    results = tp2_results[0]["gpt2"]
    assert not any(results["reference overlapped"].values())
    every_linear = {"qkv": True, "proj": True, "fc1": True, "fc2": True, "output_layer": False}
    assert results["default"]["overlapped"] == every_linear
    # 2 layers, two forwards (loss, logits) and one backward: forward gathers for qkv and fc1, backward gathers for
    # proj and fc2; forward reduce-scatters for proj and fc2 (and, with rs_dgrad, the qkv and fc1 input gradients).
    assert results["default"]["counts"] == {"gather_then_gemm": 12, "start_gemm_then_reduce_scatter": 8}
    # qkv's forward gather is not pipelined (disable_qkv); the dgrad reduce-scatters are.
    assert results["rs_dgrad, no bulk, qkv not overlapped"]["counts"] == {
        "gather_then_gemm": 8,
        "start_gemm_then_reduce_scatter": 12,
    }
    assert results["bulk overlaps only"]["counts"] == {}


def test_layers_alone_with_uneven_chunks_and_gradient_accumulation_fusion(tp2_results):
    for rank, results in enumerate(tp2_results):
        layers = results["layers"]
        for index, (plain, overlapped) in enumerate(zip(layers[False], layers[True])):
            assert torch.equal(plain, overlapped), f"rank {rank}: layer result {index} differs"
        # Both paths hand autograd what layers.py's gradient-accumulation-fusion step gives it.
        assert layers["True grads are placeholders"] == layers["False grads are placeholders"]


def test_num_chunks_divides_the_rows():
    assert [comm_overlap._num_chunks(rows, 4) for rows in (1, 2, 3, 5, 6, 8, 16)] == [1, 2, 3, 1, 3, 4, 4]


# ---- bad input: refused before any collective ------------------------------------------------------------------


def test_config_refuses_overlap_without_sequence_parallel_or_at_tp1():
    with pytest.raises(ValueError, match="tp_comm_overlap=True needs sequence_parallel=True"):
        ModelParallelConfig(tensor_model_parallel_size=2, tp_comm_overlap=True)
    with pytest.raises(ValueError, match="tp_comm_overlap=True has nothing to overlap at tensor_model_parallel_size=1"):
        ModelParallelConfig(tensor_model_parallel_size=1, tp_comm_overlap=True)


def _args(**overrides):
    values = dict(tp_comm_overlap=True, tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap_cfg=None)
    values.update(fp8=None)
    values.update(overrides)
    return types.SimpleNamespace(**values)


def test_flags_refused_without_sequence_parallel_or_at_tp1_and_missing_cfg(tmp_path):
    with pytest.raises(ValueError, match="--tp-comm-overlap needs --sequence-parallel"):
        validate_tp_comm_overlap_args(_args(sequence_parallel=False))
    with pytest.raises(
        ValueError, match="--tp-comm-overlap has nothing to overlap with --tensor-model-parallel-size 1"
    ):
        validate_tp_comm_overlap_args(_args(tensor_model_parallel_size=1, sequence_parallel=False))
    missing = tmp_path / "ub.yaml"
    with pytest.raises(ValueError, match="--tp-comm-overlap-cfg .*ub.yaml: no such file"):
        validate_tp_comm_overlap_args(_args(tp_comm_overlap_cfg=str(missing)))
    validate_tp_comm_overlap_args(_args(tp_comm_overlap=False, sequence_parallel=False, tp_comm_overlap_cfg="x"))


def test_fp8_with_overlap_is_refused_by_flag_and_by_config():
    # The overlapped GEMMs bypass the FP8 linear: together they would silently train in high precision.
    with pytest.raises(ValueError, match="--tp-comm-overlap with --fp8-format hybrid: the overlapped GEMMs do not"):
        validate_tp_comm_overlap_args(_args(fp8="hybrid"))
    from megatron.core.transformer import TransformerConfig

    with pytest.raises(ValueError, match="fp8='hybrid' with tp_comm_overlap=True: the overlapped GEMMs"):
        TransformerConfig(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=4,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            tp_comm_overlap=True,
            fp8="hybrid",
        )


def test_userbuffers_cfg_is_accepted_with_a_warning(tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("qkv_fprop:\n  method: ring_exchange\n")
    with pytest.warns(UserWarning, match="tunes Transformer Engine's userbuffers kernels.*not read"):
        validate_tp_comm_overlap_args(_args(tp_comm_overlap_cfg=str(cfg)))


def test_pretrain_flags_reach_the_config():
    from megatron.training.arguments import core_transformer_config_from_args
    from tests.unit_tests.training.test_arguments import validated

    tp2 = ("--tensor-model-parallel-size", "2", "--tp-comm-overlap")
    with pytest.raises(ValueError, match="--tp-comm-overlap needs --sequence-parallel"):
        validated(*tp2, world_size=2)
    args = validated(*tp2, "--sequence-parallel", "--tp-comm-overlap-rs-dgrad", "--no-tp-comm-bulk-wgrad", world_size=2)
    config = core_transformer_config_from_args(args)
    assert (config.tp_comm_overlap, config.tp_comm_overlap_rs_dgrad, config.tp_comm_bulk_wgrad) == (True, True, False)
