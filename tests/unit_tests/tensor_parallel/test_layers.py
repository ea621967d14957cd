"""ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding at TP=2 and 4, with and without sequence
parallelism, against the TP=1 layers and against plain torch.nn.functional (outputs and gathered gradients)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_tensor_model_parallel_attributes,
    model_parallel_cuda_manual_seed,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.utils import init_method_normal
from tests.unit_tests.tensor_parallel.common import (
    assert_rel_close,
    gather,
    gather_list,
    local_slice,
    sum_over_tp,
    tp_rank,
    tp_size,
)
from tests.unit_tests.test_utilities import Utils, run_distributed

S, B, H, FFN, VOCAB = 8, 2, 8, 16, 16
SEED = 1234
INIT = init_method_normal(0.5)  # large weights keep every output far from zero, so relative errors mean something


def _inputs():
    """The global batch and upstream gradients, identical on every rank and every TP size."""
    g = torch.Generator().manual_seed(7)
    return {
        "x": torch.randn(S, B, H, generator=g),
        "ffn_in": torch.randn(S, B, FFN, generator=g),
        "ids": torch.randint(0, VOCAB, (B, S), generator=g),
        "grad_h": torch.randn(S, B, H, generator=g),
        "grad_ffn": torch.randn(S, B, FFN, generator=g),
        "grad_vocab": torch.randn(S, B, VOCAB, generator=g),
    }


def _unstride(shards, stride: int, dim: int) -> torch.Tensor:
    """Reassemble a master tensor from per-rank shards that each hold ``stride`` interleaved blocks."""
    blocks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([blocks[r][j] for j in range(stride) for r in range(len(shards))], dim=dim)


def _seq(t, sp):
    """This rank's input: its sequence slice under sequence parallelism, else the whole tensor."""
    return (local_slice(t, 0) if sp else t).clone().requires_grad_()


def _full_seq(t, sp):
    return gather(t, 0) if sp else t.detach()


def _run_layers(sequence_parallel: bool):
    """Every layer case on this rank; returns full-size (gathered) outputs, weights and gradients."""
    sp = sequence_parallel
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp_size(), sequence_parallel=sp, use_cpu_initialization=True
    )
    data = _inputs()
    results = {}

    # MLP: column (input replicated, or the sequence slice under SP) -> gelu -> row (all-reduce / reduce-scatter).
    torch.manual_seed(SEED)
    fc1 = ColumnParallelLinear(H, FFN, config=config, init_method=INIT, keep_master_weight_for_test=True)
    fc2 = RowParallelLinear(
        FFN, H, config=config, init_method=INIT, bias=True, input_is_parallel=True, skip_bias_add=False
    )
    with torch.no_grad():  # non-zero biases, so the tests see where they are added
        fc1.bias.copy_(local_slice(torch.linspace(-1, 1, FFN), 0))
        fc2.bias.copy_(torch.linspace(1, 2, H))
    x = _seq(data["x"], sp)
    hidden, no_bias = fc1(x)
    assert no_bias is None and hidden.shape == (S, B, FFN // tp_size())
    out, no_bias = fc2(F.gelu(hidden))
    assert no_bias is None
    (out * _seq(data["grad_h"], sp).detach()).sum().backward()
    assert fc2.bias.sequence_parallel == sp
    assert (fc1.weight.partition_dim, fc2.weight.partition_dim, fc1.bias.partition_dim) == (0, 1, 0)
    assert torch.equal(fc1.master_weight, gather(fc1.weight, 0))
    results["mlp"] = {
        "out": _full_seq(out, sp),
        "x_grad": _full_seq(x.grad, sp),
        "fc1_weight": gather(fc1.weight, 0),
        "fc1_weight_grad": gather(fc1.weight.grad, 0),
        "fc1_bias_grad": gather(fc1.bias.grad, 0),
        "fc2_weight": gather(fc2.weight, 1),
        "fc2_weight_grad": gather(fc2.weight.grad, 1),
        # Under SP each rank's row-parallel bias gradient covers its slice of the sequence only.
        "fc2_bias_grad": sum_over_tp(fc2.bias.grad) if sp else fc2.bias.grad,
    }

    # SwiGLU fc1: one [gate; up] weight with stride 2, so every rank holds [gate_r; up_r].
    torch.manual_seed(SEED + 1)
    fc = ColumnParallelLinear(H, 2 * FFN, config=config, init_method=INIT, stride=2)
    with torch.no_grad():
        gate_bias, up_bias = torch.linspace(-1, 0, FFN), torch.linspace(0, 1, FFN)
        fc.bias.copy_(torch.cat([local_slice(gate_bias, 0), local_slice(up_bias, 0)]))
    x = _seq(data["x"], sp)
    out, _ = fc(x)
    gate, up = out.chunk(2, dim=-1)
    (F.silu(gate) * up * local_slice(data["grad_ffn"], -1)).sum().backward()
    results["swiglu"] = {
        "gate": gather(gate, -1),
        "up": gather(up, -1),
        "x_grad": _full_seq(x.grad, sp),
        "weight": _unstride(gather_list(fc.weight), 2, 0),
        "weight_grad": _unstride(gather_list(fc.weight.grad), 2, 0),
        "bias_grad": _unstride(gather_list(fc.bias.grad), 2, 0),
    }

    # gather_output + skip_bias_add: the full output without the bias, which comes back for the caller to add.
    torch.manual_seed(SEED + 2)
    fc = ColumnParallelLinear(H, FFN, config=config, init_method=INIT, gather_output=True, skip_bias_add=True)
    x = _seq(data["x"], sp)
    out, bias = fc(x)
    assert bias is fc.bias
    local_out, _ = fc(x.detach(), runtime_gather_output=False)
    assert torch.equal(local_out, local_slice(out.detach(), -1))
    (out * data["grad_ffn"]).sum().backward()
    results["column_gather"] = {
        "out": out.detach(),
        "x_grad": _full_seq(x.grad, sp),
        "weight_grad": gather(fc.weight.grad, 0),
    }

    # Row layer that splits a replicated input itself (not allowed under SP).
    torch.manual_seed(SEED + 3)
    if sp:
        with pytest.raises(ValueError, match="sequence_parallel=True needs input_is_parallel=True"):
            RowParallelLinear(
                FFN, H, config=config, init_method=INIT, bias=True, input_is_parallel=False, skip_bias_add=True
            )
    else:
        row = RowParallelLinear(
            FFN, H, config=config, init_method=INIT, bias=True, input_is_parallel=False, skip_bias_add=True
        )
        x = data["ffn_in"].clone().requires_grad_()
        out, bias = row(x)
        assert bias is row.bias and row.bias.sequence_parallel is False
        (out * data["grad_h"]).sum().backward()
        results["row_split"] = {"out": out.detach(), "x_grad": x.grad, "weight_grad": gather(row.weight.grad, 1)}

    # GPT-style embedding and tied output layer: the column layer gets the embedding's weight in forward().
    torch.manual_seed(SEED + 4)
    embedding = VocabParallelEmbedding(VOCAB, H, init_method=INIT, reduce_scatter_embeddings=sp, config=config)
    output_layer = ColumnParallelLinear(
        H, VOCAB, config=config, init_method=INIT, bias=False, skip_weight_param_allocation=True
    )
    assert output_layer.weight is None
    embedded = embedding(data["ids"])  # [b, s, h], or [s/tp, b, h] reduce-scattered under SP
    embedded.retain_grad()
    hidden = embedded if sp else embedded.transpose(0, 1)
    logits, _ = output_layer(hidden, weight=embedding.weight)
    (logits * local_slice(data["grad_vocab"], -1)).sum().backward()
    results["embedding"] = {
        "embedded": _full_seq(embedded, sp) if sp else embedded.detach().transpose(0, 1),
        "embedded_grad": _full_seq(embedded.grad, sp) if sp else embedded.grad.transpose(0, 1),
        "logits": gather(logits, -1),
        "weight": gather(embedding.weight, 0),
        "weight_grad": gather(embedding.weight.grad, 0),
    }
    return results


def _layer_results(tp, sequence_parallel):
    Utils.initialize_model_parallel(tp)
    model_parallel_cuda_manual_seed(SEED)
    results = _run_layers(sequence_parallel)
    return results if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def tp1_results():
    """The same cases run in this process without model-parallel groups (TP=1)."""
    rng_state = torch.get_rng_state()
    try:
        return _run_layers(sequence_parallel=False)
    finally:
        torch.set_rng_state(rng_state)


@pytest.mark.parametrize(
    "tp, world_size, sequence_parallel", [(2, 4, False), (2, 2, True), (4, 4, False), (4, 4, True)]
)
def test_layers_match_tp1(tp1_results, tp, world_size, sequence_parallel):
    got = run_distributed(world_size, _layer_results, tp, sequence_parallel)[0]
    expected_cases = set(tp1_results) - ({"row_split"} if sequence_parallel else set())
    assert set(got) == expected_cases
    for case in expected_cases:
        for name, expected in tp1_results[case].items():
            actual = got[case][name]
            if name in ("fc1_weight", "fc2_weight", "weight"):
                # CPU initialisation: the assembled master weight is bit-identical for every TP size.
                assert torch.equal(actual, expected), f"{case}.{name} differs from TP=1"
            else:
                assert_rel_close(actual, expected, what=f"tp={tp} sp={sequence_parallel} {case}.{name}")


def test_tp1_layers_match_plain_torch(tp1_results):
    data = _inputs()

    mlp = tp1_results["mlp"]
    x, w1, w2 = (t.clone().requires_grad_() for t in (data["x"], mlp["fc1_weight"], mlp["fc2_weight"]))
    b1, b2 = torch.linspace(-1, 1, FFN).requires_grad_(), torch.linspace(1, 2, H).requires_grad_()
    out = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    (out * data["grad_h"]).sum().backward()
    for name, expected in [
        ("out", out),
        ("x_grad", x.grad),
        ("fc1_weight_grad", w1.grad),
        ("fc1_bias_grad", b1.grad),
        ("fc2_weight_grad", w2.grad),
        ("fc2_bias_grad", b2.grad),
    ]:
        assert_rel_close(mlp[name], expected.detach(), what=f"mlp.{name}")

    swiglu = tp1_results["swiglu"]
    x, w = data["x"].clone().requires_grad_(), swiglu["weight"].clone().requires_grad_()
    b = torch.cat([torch.linspace(-1, 0, FFN), torch.linspace(0, 1, FFN)]).requires_grad_()
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    (F.silu(gate) * up * data["grad_ffn"]).sum().backward()
    for name, expected in [
        ("gate", gate),
        ("up", up),
        ("x_grad", x.grad),
        ("weight_grad", w.grad),
        ("bias_grad", b.grad),
    ]:
        assert_rel_close(swiglu[name], expected.detach(), what=f"swiglu.{name}")

    embedding = tp1_results["embedding"]
    table = embedding["weight"].clone().requires_grad_()
    embedded = F.embedding(data["ids"], table).transpose(0, 1)
    embedded.retain_grad()
    logits = F.linear(embedded, table)
    (logits * data["grad_vocab"]).sum().backward()
    reference = torch.nn.Embedding(VOCAB, H, _weight=embedding["weight"].clone())
    assert torch.equal(embedding["embedded"], reference(data["ids"]).detach().transpose(0, 1))
    for name, expected in [("logits", logits), ("embedded_grad", embedded.grad), ("weight_grad", table.grad)]:
        assert_rel_close(embedding[name], expected.detach(), what=f"embedding.{name}")


def test_tp1_row_layer_splitting_its_input_matches_plain_torch(tp1_results):
    data = _inputs()
    torch.manual_seed(SEED + 3)
    weight = torch.empty(H, FFN)
    INIT(weight)  # what CPU initialisation draws for the row layer at TP=1
    x, w = data["ffn_in"].clone().requires_grad_(), weight.requires_grad_()
    out = F.linear(x, w)  # skip_bias_add: the (zero) bias is left to the caller
    (out * data["grad_h"]).sum().backward()
    row = tp1_results["row_split"]
    assert_rel_close(row["out"], out.detach(), what="row_split.out")
    assert_rel_close(row["x_grad"], x.grad, what="row_split.x_grad")
    assert_rel_close(row["weight_grad"], w.grad, what="row_split.weight_grad")


# ---- initialisation without CPU master weights, and errors that need TP > 1 ------------------------------------------


def _check_sharded_init_and_errors(tp):
    Utils.initialize_model_parallel(tp)
    model_parallel_cuda_manual_seed(SEED)
    config = ModelParallelConfig(tensor_model_parallel_size=tp)
    default_state = torch.get_rng_state()

    # Each rank initialises its own shard from the tensor-parallel stream: seed + 2718 + tp_rank.
    layer = ColumnParallelLinear(H, FFN, config=config, init_method=init_method_normal(0.02))
    stream = torch.Generator().manual_seed(SEED + 2718 + tp_rank())
    assert torch.equal(layer.weight, torch.empty(FFN // tp, H).normal_(0.0, 0.02, generator=stream))
    assert torch.equal(layer.bias, torch.zeros(FFN // tp))
    assert torch.equal(torch.get_rng_state(), default_state), "sharded init must not consume the default stream"

    # An expert layer draws from the expert stream (seed + 1024 + 100 * ep_rank + expert_tp_rank) and leaves all
    # communication to the MoE dispatcher: its output is the local product.
    expert = ColumnParallelLinear(H, FFN, config=config, init_method=init_method_normal(0.02), is_expert=True)
    expert_stream = torch.Generator().manual_seed(SEED + 1024 + tp_rank())
    assert torch.equal(expert.weight, torch.empty(FFN // tp, H).normal_(0.0, 0.02, generator=expert_stream))
    assert expert.weight.allreduce  # no expert parallelism: expert weights are reduced like dense ones
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(tp_rank()))  # differs per rank
    assert torch.equal(expert(x)[0], torch.nn.functional.linear(x, expert.weight, expert.bias))

    # disable_grad_reduce: the input gradient stays this rank's partial sum (the caller reduces it).
    local_only = ColumnParallelLinear(H, FFN, config=config, init_method=INIT, disable_grad_reduce=True)
    x = torch.ones(S, B, H, requires_grad=True)
    local_only(x)[0].sum().backward()
    assert_rel_close(x.grad, torch.ones(S, B, FFN // tp) @ local_only.weight.detach(), what="disable_grad_reduce")

    # perform_initialization=False never calls the init method, but still tags the weight.
    def must_not_run(tensor):
        raise AssertionError("init_method called although perform_initialization=False")

    skipped = RowParallelLinear(
        FFN,
        H,
        config=dataclasses.replace(config, perform_initialization=False),
        init_method=must_not_run,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=False,
    )
    assert skipped.bias is None and skipped.weight.shape == (H, FFN // tp) and skipped.weight.partition_dim == 1

    # A replicated parameter counts once (on TP rank 0); a split one counts everywhere.
    replicated = torch.nn.Parameter(torch.ones(2))
    assert param_is_not_tensor_parallel_duplicate(replicated) == (tp_rank() == 0)
    assert param_is_not_tensor_parallel_duplicate(layer.weight)

    with pytest.raises(
        ValueError,
        match=rf"ColumnParallelLinear: output_size={tp + 1} is not divisible by the "
        rf"tensor-parallel size {tp}; choose sizes",
    ):
        ColumnParallelLinear(H, tp + 1, config=config, init_method=INIT)
    with pytest.raises(
        ValueError,
        match=rf"ColumnParallelLinear: output_size={2 * tp} is not divisible by the "
        rf"tensor-parallel size {tp} x stride 4",
    ):
        ColumnParallelLinear(H, 2 * tp, config=config, init_method=INIT, stride=4)
    with pytest.raises(
        ValueError,
        match=rf"RowParallelLinear: input_size={tp + 1} is not divisible by the "
        rf"tensor-parallel size {tp}",
    ):
        RowParallelLinear(
            tp + 1, H, config=config, init_method=INIT, bias=True, input_is_parallel=True, skip_bias_add=False
        )
    with pytest.raises(
        ValueError,
        match=rf"vocabulary size {tp + 1} is not divisible by the tensor-parallel size "
        rf"{tp}; pad it",
    ):
        VocabParallelEmbedding(tp + 1, H, init_method=INIT, config=config)
    with pytest.raises(
        ValueError,
        match=rf"weight passed to forward\(\) has shape \({FFN}, {H}\), expected "
        rf"\({FFN // tp}, {H}\)",
    ):
        layer(torch.ones(S, B, H), weight=torch.ones(FFN, H))
    return True


def test_sharded_initialisation_and_size_errors():
    assert run_distributed(2, _check_sharded_init_and_errors, 2) == [True, True]


# ---- single-process checks ---------------------------------------------------------------------------------------


def test_forward_needs_a_weight_when_none_was_allocated():
    layer = ColumnParallelLinear(
        H, FFN, config=ModelParallelConfig(), init_method=INIT, skip_weight_param_allocation=True
    )
    with pytest.raises(ValueError, match=r"skip_weight_param_allocation=True, so forward\(\) needs the weight"):
        layer(torch.ones(S, B, H))


def test_tensor_parallel_attribute_helpers():
    tensor = torch.nn.Parameter(torch.ones(4))
    set_tensor_model_parallel_attributes(tensor, is_parallel=True, dim=0, stride=2)
    assert (tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride) == (True, 0, 2)
    with pytest.raises(ValueError, match="already has the tensor-parallel attribute 'tensor_model_parallel'"):
        set_tensor_model_parallel_attributes(tensor, is_parallel=False, dim=1, stride=1)

    other = torch.nn.Parameter(torch.ones(4))
    other.partition_dim = 3
    set_defaults_if_not_set_tensor_model_parallel_attributes(other)
    assert (other.tensor_model_parallel, other.partition_dim, other.partition_stride) == (False, 3, 1)

    copy = torch.nn.Parameter(torch.ones(4))
    copy_tensor_model_parallel_attributes(copy, tensor)
    assert (copy.tensor_model_parallel, copy.partition_dim, copy.partition_stride) == (True, 0, 2)


def test_optimizer_tags_are_tensor_parallel_attributes_too():
    # Megatron's set: expert and fused-QKV tags travel with a parameter's copies (e.g. fp32 main params).
    source = torch.nn.Parameter(torch.ones(4))
    source.is_qkv, source.qkv_split_shapes, source.expert_tp = True, [2, 1, 1], True
    copy = torch.nn.Parameter(torch.ones(4))
    copy_tensor_model_parallel_attributes(copy, source)
    assert (copy.is_qkv, copy.qkv_split_shapes, copy.expert_tp) == (True, [2, 1, 1], True)
    assert not hasattr(copy, "tensor_model_parallel")  # only attributes the source has are copied

    plain = torch.nn.Parameter(torch.ones(4))
    set_defaults_if_not_set_tensor_model_parallel_attributes(plain)
    assert (plain.is_qkv, plain.qkv_split_shapes, plain.expert_tp) == (False, None, False)

    tagged = torch.nn.Parameter(torch.ones(4))
    tagged.is_qkv = True
    with pytest.raises(ValueError, match="already has the tensor-parallel attribute 'is_qkv'"):
        set_tensor_model_parallel_attributes(tagged, is_parallel=True, dim=0, stride=1)


class _RankGroup:
    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank


def test_duplicate_filter_asks_the_given_group_for_this_ranks_index():
    # Megatron's check: a replicated parameter counts on rank 0 of the group passed in, initialised or not.
    param = torch.nn.Parameter(torch.ones(1))
    assert not param_is_not_tensor_parallel_duplicate(param, _RankGroup(1))
    assert param_is_not_tensor_parallel_duplicate(param, _RankGroup(0))
    param.allreduce = False  # an expert parameter: replicated over the expert tensor-parallel group instead
    assert param_is_not_tensor_parallel_duplicate(param, tp_group=_RankGroup(1), expert_tp_group=_RankGroup(0))
    assert not param_is_not_tensor_parallel_duplicate(param, tp_group=_RankGroup(0), expert_tp_group=_RankGroup(1))
