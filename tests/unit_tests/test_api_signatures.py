"""Public API signatures match Megatron-Core's: parameter names, their order, and which are keyword-only.

Each snapshot lists Megatron-Core's parameters in Megatron's order. Ours may add optional parameters after them
(such as ``pg_collection``), never rename, reorder or drop one.
"""

import inspect

import pytest

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer

KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY

SNAPSHOTS = [
    (
        parallel_state.initialize_model_parallel,
        ["tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"],
        {
            "context_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "order",
            "distributed_timeout_minutes",
            "get_embedding_ranks",
            "get_position_embedding_ranks",
            "create_gloo_process_groups",
            "num_distributed_optimizer_instances",
            "use_sharp",
        },
    ),
    (
        GPTModel.__init__,
        [
            "self",
            "config",
            "transformer_layer_spec",
            "vocab_size",
            "max_sequence_length",
            "pre_process",
            "post_process",
            "fp16_lm_cross_entropy",
            "parallel_output",
            "share_embeddings_and_output_weights",
            "position_embedding_type",
            "rotary_percent",
            "rotary_base",
            "rope_scaling",
            "rope_scaling_factor",
            "scatter_embedding_sequence_parallel",
            "seq_len_interpolation_factor",
        ],
        {"mtp_block_spec", "vp_stage"},
    ),
    (
        GPTModel.forward,
        [
            "self",
            "input_ids",
            "position_ids",
            "attention_mask",
            "decoder_input",
            "labels",
            "inference_context",
            "packed_seq_params",
            "extra_block_kwargs",
            "runtime_gather_output",
        ],
        {"inference_params", "loss_mask"},
    ),
    (
        tensor_parallel.ColumnParallelLinear.__init__,
        [
            "self",
            "input_size",
            "output_size",
            "config",
            "init_method",
            "bias",
            "gather_output",
            "stride",
            "keep_master_weight_for_test",
            "skip_bias_add",
            "skip_weight_param_allocation",
            "embedding_activation_buffer",
            "grad_output_buffer",
            "is_expert",
            "tp_comm_buffer_name",
            "disable_grad_reduce",
        ],
        set(),
    ),
    (tensor_parallel.ColumnParallelLinear.forward, ["self", "input_", "weight", "runtime_gather_output"], set()),
    (
        tensor_parallel.RowParallelLinear.__init__,
        [
            "self",
            "input_size",
            "output_size",
            "config",
            "init_method",
            "bias",
            "input_is_parallel",
            "skip_bias_add",
            "stride",
            "keep_master_weight_for_test",
            "is_expert",
            "tp_comm_buffer_name",
        ],
        set(),
    ),
    (
        tensor_parallel.VocabParallelEmbedding.__init__,
        ["self", "num_embeddings", "embedding_dim", "init_method", "reduce_scatter_embeddings", "config"],
        set(),
    ),
    (tensor_parallel.vocab_parallel_cross_entropy, ["vocab_parallel_logits", "target", "label_smoothing"], set()),
    (tensor_parallel.checkpoint, ["function", "distribute_saved_activations", "args"], set()),
    (tensor_parallel.broadcast_data, ["keys", "data", "datatype"], set()),
    (tensor_parallel.model_parallel_cuda_manual_seed, ["seed"], {"te_rng_tracker", "inference_rng_tracker"}),
    (
        get_gpt_layer_local_spec,
        ["num_experts", "moe_grouped_gemm", "qk_layernorm", "multi_latent_attention", "fp8"],
        {"normalization", "qk_l2_norm"},
    ),
    (
        TransformerBlock.__init__,
        ["self", "config", "spec", "post_layer_norm", "pre_process", "post_process"],
        {"vp_stage"},
    ),
    (TransformerLayer.__init__, ["self", "config", "submodules", "layer_number", "hidden_dropout"], set()),
]


@pytest.mark.parametrize("function, leading, also", SNAPSHOTS, ids=lambda x: getattr(x, "__qualname__", ""))
def test_signature_matches_megatron(function, leading, also):
    names = list(inspect.signature(function).parameters)
    assert names[: len(leading)] == leading
    assert also <= set(names), f"missing {also - set(names)}"


@pytest.mark.parametrize(
    "cls",
    [tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear, tensor_parallel.VocabParallelEmbedding],
)
def test_layer_arguments_after_sizes_are_keyword_only(cls):
    """Megatron declares everything after the sizes keyword-only (``*, config, init_method, ...``)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[3:]
    assert parameters and all(p.kind == KEYWORD_ONLY for p in parameters)


def test_mpu_alias():
    from megatron.core import mpu

    assert mpu is parallel_state
