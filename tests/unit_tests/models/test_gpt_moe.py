"""GPTModel with MoE layers (mixed with dense ones by moe_layer_freq): the block spec places them, forward and
backward run with the aux losses in the backward, and TP2 x EP2 with sequence parallelism, and EP2 x PP2 through the
pipeline schedule, equal one process over the same global batch (loss and every gradient, experts by global index,
logged losses); TP2 without sequence parallelism evaluates to one process's logits; a bf16 model keeps its dtypes
with fp32 routing."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.models.gpt_test_helpers import relative_error
from tests.unit_tests.test_utilities import Utils, run_distributed
from tests.unit_tests.transformer.moe.moe_test_helpers import fresh_moe_state, reduced_tracker, summed_full_gradients

VOCAB, SEQ, BATCH = 64, 8, 2


def _model(tp=1, ep=1, seed=1234, sequence_parallel=None, dispatcher="alltoall"):
    Utils.initialize_model_parallel(tp, expert_model_parallel_size=ep)
    fresh_moe_state()
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_layer_freq=[1, 0],
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=1e-3,
        moe_shared_expert_intermediate_size=16,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1 if sequence_parallel is None else sequence_parallel,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def _batches(count):
    generator = torch.Generator().manual_seed(11)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        )
        for _ in range(count)
    ]


def _step(model, tokens, labels):
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    loss = model(tokens, position_ids, None, labels=labels).mean()
    loss.backward()
    return loss.item()


def _reference(num_batches):
    model = _model()
    layers = model.decoder.layers
    kinds = [type(layer.mlp) for layer in layers]
    losses = [_step(model, tokens, labels) for tokens, labels in _batches(num_batches)]
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    tracker = {name: values / num_batches for name, values in reduced_tracker().items()}
    return kinds, losses, grads, missing, tracker


def _parallel(tp, ep, num_batches):
    model = _model(tp, ep)
    tokens, labels = _batches(num_batches)[parallel_state.get_data_parallel_rank()]
    loss = _step(model, tokens, labels)
    return parallel_state.get_data_parallel_rank(), loss, summed_full_gradients(model), reduced_tracker()


def test_gpt_with_moe_layers_matches_single_process_at_tp2_ep2():
    kinds, losses, grads, missing, tracker = run_distributed(1, _reference, 2)[0]
    assert kinds == [MoELayer, MLP]
    assert not missing, f"parameters without a gradient: {missing}"
    assert set(tracker) == {"load_balancing_loss", "z_loss"} and tracker["z_loss"][1] == 0  # layer 2 is dense
    for dp_rank, loss, parallel_grads, parallel_tracker in run_distributed(4, _parallel, 2, 2, 2):
        assert abs(loss - losses[dp_rank]) <= 1e-5 * abs(losses[dp_rank])
        assert parallel_grads.keys() == grads.keys()
        for name, grad in grads.items():
            assert relative_error(parallel_grads[name], grad) <= 1e-5, name
        for name, values in tracker.items():
            assert relative_error(parallel_tracker[name], values) <= 1e-5, name


def _eval_logits_and_loss(tp, sequence_parallel, dispatcher):
    from tests.unit_tests.models.gpt_test_helpers import gather_logits

    model = _model(tp, sequence_parallel=sequence_parallel, dispatcher=dispatcher).eval()
    ((tokens, labels),) = _batches(1)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    with torch.no_grad():
        logits = gather_logits(model(tokens, position_ids, None))
        loss = model(tokens, position_ids, None, labels=labels).mean().item()
    return logits, loss


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_eval_at_tp2_without_sequence_parallel_matches_one_process(dispatcher):
    """Megatron evaluates (and generates with) an MoE model at TP > 1 without sequence parallelism: same logits and
    loss as one process and as TP2 with sequence parallelism."""
    ((expected_logits, expected_loss),) = run_distributed(1, _eval_logits_and_loss, 1, False, dispatcher)
    for sequence_parallel in (False, True):
        for logits, loss in run_distributed(2, _eval_logits_and_loss, 2, sequence_parallel, dispatcher):
            assert relative_error(logits, expected_logits) <= 1e-5
            assert loss == pytest.approx(expected_loss, rel=1e-5)


def _bf16(grouped):
    from megatron.core.transformer.module import Float16Module

    Utils.initialize_model_parallel(1, expert_model_parallel_size=2)
    fresh_moe_state()
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        num_moe_experts=4,
        moe_router_topk=2,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        moe_router_dtype="fp32",
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_aux_loss_coeff=0.01,
        expert_model_parallel_size=2,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped,
    )
    model = Float16Module(
        config, GPTModel(config, get_gpt_decoder_block_spec(config, False), vocab_size=VOCAB, max_sequence_length=SEQ)
    )
    outputs = []
    model.module.decoder.layers[0].mlp.register_forward_hook(lambda m, i, o: outputs.append(o[0].dtype))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=tokens).mean().backward()
    router = model.module.decoder.layers[0].mlp.router
    return outputs[0], router.expert_bias.dtype, router.weight.grad.dtype, router.local_tokens_per_expert.sum().item()


def test_bf16_model_with_fp32_routing_keeps_its_dtypes():
    for grouped in (False, True):
        for output_dtype, bias_dtype, grad_dtype, routed in run_distributed(2, _bf16, grouped):
            assert output_dtype == torch.bfloat16 and grad_dtype == torch.bfloat16
            assert bias_dtype == torch.float32  # the aux-loss-free bias stays fp32 inside a Float16Module
            assert routed == BATCH * SEQ * 2  # every token counted at its 2 experts


def _pipeline(pp, ep, num_microbatches):
    """The MoE GPT through the pipeline schedule: each data-parallel rank runs its share of the micro-batches."""
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from tests.unit_tests.models.gpt_test_helpers import SEQ as PIPE_SEQ, VOCAB as PIPE_VOCAB
    from tests.unit_tests.pipeline_parallel.gpt_pipeline_helpers import forward_step, global_name, microbatches

    Utils.initialize_model_parallel(1, pp, expert_model_parallel_size=ep)
    fresh_moe_state()
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(
        num_layers=4,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_layer_freq=2,
        moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=1e-3,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type="alltoall",
        pipeline_dtype=torch.float32,
    )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    model = GPTModel(
        config,
        get_gpt_decoder_block_spec(config, False),
        vocab_size=PIPE_VOCAB,
        max_sequence_length=PIPE_SEQ,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp - 1,
    )
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = num_microbatches // dp_size
    batches = microbatches(num_microbatches)[dp_rank * share : (dp_rank + 1) * share]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=share,
        seq_length=PIPE_SEQ,
        micro_batch_size=2,
    )
    grads = {global_name(name, model): grad / dp_size for name, grad in summed_full_gradients(model).items()}
    stages = [None] * pp
    torch.distributed.all_gather_object(stages, grads, group=parallel_state.get_pipeline_model_parallel_group())
    merged = {name: grad for stage in stages for name, grad in stage.items()}
    # Per micro-batch, as the training log reports it (track_moe_metrics' loss_scale is 1 / micro-batches).
    tracker = {name: values / share for name, values in reduced_tracker().items()}
    return merged, tracker


def test_gpt_with_moe_layers_through_the_pipeline_at_ep2_pp2_matches_one_process():
    expected_grads, expected_tracker = run_distributed(1, _pipeline, 1, 1, 4)[0]
    for grads, tracker in run_distributed(4, _pipeline, 2, 2, 4):
        assert grads.keys() == expected_grads.keys()
        for name, grad in expected_grads.items():
            assert relative_error(grads[name], grad) <= 1e-5, name
        for name, values in expected_tracker.items():  # layers 1 and 3 are MoE, on different stages
            assert values[0] > 0 and values[2] > 0 and values[1] == 0
            assert relative_error(tracker[name], values) <= 1e-5, name
