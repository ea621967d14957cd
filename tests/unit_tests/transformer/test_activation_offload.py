"""Activation offloading (cpu_offloading_num_layers, fine_grained_activation_offloading with offload_modules): the
saved activations go to separate host buffers in forward and come back in backward, and the loss and every
gradient are bit for bit those of the run without offloading; bad settings fail naming the field."""

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import activation_offload
from megatron.core.transformer.activation_offload import HostOffloadHooks
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils, run_distributed

VOCAB, SEQ = 64, 16
NO_MIN_SIZE = dict(min_offloaded_tensor_size=0)  # the default (2^20 elements) is larger than any tensor here
BASE = dict(num_layers=3, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, hidden_dropout=0.0)


def _loss_and_grads(offload: dict, tp: int = 1):
    Utils.initialize_model_parallel(tp)
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)
    parallel = dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    config = TransformerConfig(**BASE, attention_dropout=0.0, **parallel, **offload)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    model = GPTModel(config, spec, VOCAB, SEQ)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    offloaded = []
    original_pack = HostOffloadHooks._pack

    def counting_pack(self, tensor):  # records what went to the host, and that it is a separate buffer
        packed = original_pack(self, tensor)
        if isinstance(packed, tuple):
            offloaded.append(packed[1].data_ptr() != tensor.data_ptr() and packed[1].device.type == "cpu")
        return packed

    HostOffloadHooks._pack = counting_pack
    try:
        loss = model(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).mean()
        loss.backward()
    finally:
        HostOffloadHooks._pack = original_pack
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.item(), grads, offloaded


_OFFLOAD_FIELDS = ("cpu_offloading", "cpu_offloading_num_layers", "fine_grained_activation_offloading")


def _compare(offload: dict, tp: int = 1):
    """The same model without and with the offloading fields of ``offload``."""
    model_only = {key: value for key, value in offload.items() if key not in _OFFLOAD_FIELDS}
    return _loss_and_grads(model_only, tp), _loss_and_grads(offload, tp)


@pytest.mark.parametrize(
    "offload",
    [
        dict(cpu_offloading=True, cpu_offloading_num_layers=2),
        dict(fine_grained_activation_offloading=True, offload_modules=["core_attn", "attn_proj"], **NO_MIN_SIZE),
        dict(
            fine_grained_activation_offloading=True,
            offload_modules=["attn_norm", "qkv_linear", "mlp_norm"],
            min_offloaded_tensor_size=1024,
        ),
        dict(
            fine_grained_activation_offloading=True,
            offload_modules=["expert_fc1"],
            num_moe_experts=4,
            moe_router_topk=2,
            **NO_MIN_SIZE,
        ),
    ],
    ids=["layers", "core_attn+attn_proj", "norms+qkv above 1024 elements", "expert_fc1"],
)
def test_offloaded_activations_give_bitwise_equal_gradients(offload):
    (plain, offloaded) = run_distributed(1, _compare, offload)[0]
    assert offloaded[0] == plain[0]
    for name, grad in plain[1].items():
        assert torch.equal(offloaded[1][name], grad), name
    assert plain[2] == []
    # Something was offloaded, each into its own host buffer.
    assert offloaded[2] and all(offloaded[2])


def test_offloading_under_tensor_and_sequence_parallelism_gives_bitwise_equal_gradients():
    # TP2 x DP2 with sequence parallelism: each rank offloads its own shards (sequence-split activations, head-split
    # attention), and gets back exactly the gradients of its run without offloading.
    offload = dict(fine_grained_activation_offloading=True, offload_modules=["core_attn", "mlp_norm"], **NO_MIN_SIZE)
    for rank, (plain, offloaded) in enumerate(run_distributed(4, _compare, offload, 2)):
        assert offloaded[0] == plain[0], f"rank {rank}"
        for name, grad in plain[1].items():
            assert torch.equal(offloaded[1][name], grad), f"rank {rank}: {name}"
        assert offloaded[2] and all(offloaded[2])


def test_small_tensors_and_parameters_stay_where_they_are():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    small = torch.randn(4, 8, requires_grad=True)
    large = torch.randn(64, 8, requires_grad=True)
    hooks = HostOffloadHooks(min_tensor_size=100)
    with hooks:
        ((small @ weight).sum() + large.tanh().sum()).backward()
    # Only tanh's saved output (512 fp32 elements) moved; the weight and the 32-element input were kept.
    assert hooks.offloaded_bytes == 64 * 8 * 4
    offloaded_grads = (small.grad.clone(), weight.grad.clone(), large.grad.clone())
    small.grad = weight.grad = large.grad = None
    ((small @ weight).sum() + large.tanh().sum()).backward()
    assert all(torch.equal(a, b) for a, b in zip(offloaded_grads, (small.grad, weight.grad, large.grad)))


def _selected_submodules():
    Utils.initialize_model_parallel()
    config = TransformerConfig(**BASE, fine_grained_activation_offloading=True, offload_modules=["core_attn"])
    layer = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ).decoder.layers[0]
    selected = activation_offload.offloaded_submodules(layer, ["core_attn", "mlp_norm"])
    return selected == [layer.self_attention.core_attention, layer.pre_mlp_layernorm]


def test_fine_grained_offloading_hooks_the_named_submodules():
    assert run_distributed(1, _selected_submodules) == [True]


@pytest.mark.parametrize(
    "offload, message",
    [
        (dict(cpu_offloading=True, cpu_offloading_num_layers=3), "cpu_offloading_num_layers=3 must be between 1"),
        (dict(cpu_offloading=True, cpu_offloading_num_layers=0), "cpu_offloading_num_layers=0 must be between 1"),
        (
            dict(cpu_offloading=True, cpu_offloading_num_layers=1, recompute_granularity="selective"),
            "cpu_offloading does not work with activation recomputation",
        ),
        (
            dict(cpu_offloading=True, cpu_offloading_num_layers=1, fine_grained_activation_offloading=True),
            "cpu_offloading and fine_grained_activation_offloading are both set",
        ),
        (dict(fine_grained_activation_offloading=True), "fine_grained_activation_offloading=True needs offload_mod"),
        (
            dict(fine_grained_activation_offloading=True, offload_modules=["attention"]),
            "offload_modules: 'attention' is not a module that can be offloaded; use one of",
        ),
        (
            dict(fine_grained_activation_offloading=True, offload_modules=["moe_act"]),
            "offload_modules: not supported yet: 'moe_act'",
        ),
        (dict(min_offloaded_tensor_size=-1), "min_offloaded_tensor_size=-1 must be >= 0"),
        (dict(cpu_offloading_weights=True), r"not supported yet: CPU offloading of weights"),
    ],
)
def test_bad_offloading_settings_name_the_field(offload, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**BASE, **offload)
