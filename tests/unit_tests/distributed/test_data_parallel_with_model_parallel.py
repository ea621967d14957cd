"""Data parallelism combined with tensor parallelism (GPT, TP=2 with sequence parallelism) and with pipeline
parallelism (PP=2 through the 1F1B schedule, tied embeddings): weights and gradient norms match one process."""

import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from tests.unit_tests.distributed.ddp_test_helpers import (
    SEQ,
    TinyLM,
    make_batch,
    max_relative_error,
    model_config,
    train_reference,
    weights,
)
from tests.unit_tests.models import gpt_test_helpers as gpt
from tests.unit_tests.test_utilities import Utils, run_distributed

STEPS, GLOBAL_BATCH = 2, 4
LAYOUTS = {
    "plain": dict(),
    "distopt+overlap": dict(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=2000
    ),
}


def _opt_config(distributed: bool) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, use_distributed_optimizer=distributed)


def _gpt_batch(step: int):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, gpt.VOCAB, (GLOBAL_BATCH, gpt.SEQ), generator=generator)
    labels = torch.randint(0, gpt.VOCAB, (GLOBAL_BATCH, gpt.SEQ), generator=generator)
    return tokens, torch.arange(gpt.SEQ).expand(GLOBAL_BATCH, gpt.SEQ), labels


def _train_gpt(model, optimizer, ddp=None):
    dp_rank = parallel_state.get_data_parallel_rank() if ddp is not None else 0
    dp_size = parallel_state.get_data_parallel_world_size() if ddp is not None else 1
    norms = []
    for step in range(STEPS):
        if ddp is not None:
            ddp.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, positions, labels = (t.chunk(dp_size)[dp_rank] for t in _gpt_batch(step))
        (ddp or model)(tokens, positions, None, labels=labels).mean().backward()
        finalize_model_grads([ddp or model])
        norms.append(optimizer.step()[1])
    return norms


def _gpt_tensor_and_data_parallel():
    # Reference first (TP=1), then the same model at TP=2 with sequence parallelism over DP=2.
    reference = gpt.build_model(1, False, "llama")
    reference_norms = _train_gpt(reference, get_megatron_optimizer(_opt_config(False), [reference]))
    expected = gpt.full_weights(reference)
    results = {}
    for name, layout in LAYOUTS.items():
        model = gpt.build_model(2, True, "llama")
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(**layout), model)
        optimizer = get_megatron_optimizer(_opt_config(ddp.ddp_config.use_distributed_optimizer), [ddp])
        norms = _train_gpt(model, optimizer, ddp)
        ddp.state_dict()  # completes the last step's pending parameter all-gather
        results[name] = (
            max_relative_error(gpt.full_weights(model), expected),
            max(abs(a - b) / b for a, b in zip(norms, reference_norms)),
        )
    return results


def test_tensor_parallel_with_sequence_parallel_and_data_parallel_match_single_process():
    for rank, results in enumerate(run_distributed(4, _gpt_tensor_and_data_parallel)):
        for layout, (weight_error, norm_error) in results.items():
            # Several Adam steps (lr 1e-2) amplify fp32 rounding differences between the TP=2+SP and TP=1 matmuls
            # (the gradients themselves agree to 1e-5: see the grad-norm check and the model tests); both DP
            # layouts land on the same weights, so DP itself adds nothing.
            assert weight_error < 1e-4, f"TP=2 DP=2 {layout} rank {rank}: weights off by {weight_error:.2e}"
            assert norm_error < 1e-5, f"TP=2 DP=2 {layout} rank {rank}: grad norm off by {norm_error:.2e}"


MICROBATCHES, LAYERS_PER_STAGE = 2, 2


def _stage_name_in_full_model(name: str, pp_rank: int) -> str:
    """TinyLM stage names -> full-model names (layer index offset; the last stage's tied output copy)."""
    if name.startswith("layers."):
        index, rest = name[len("layers.") :].split(".", 1)
        return f"layers.{int(index) + pp_rank * LAYERS_PER_STAGE}.{rest}"
    return "embedding.weight" if name == "output" else name


def _forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    loss = model(tokens, labels)
    return loss, lambda output: (output, {"loss": output.detach()})


def _pipeline_and_data_parallel():
    # The reference runs before the pipeline groups exist: its gradient norm must not be summed over stages.
    Utils.initialize_model_parallel()
    reference = TinyLM(tie=True)
    reference_norms = train_reference(reference, _opt_config(False), STEPS, GLOBAL_BATCH, MICROBATCHES)
    expected = weights(reference)
    Utils.initialize_model_parallel(pipeline_model_parallel_size=2)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    micro_batch_size = GLOBAL_BATCH // dp_size // MICROBATCHES
    results = {}
    for name, layout in LAYOUTS.items():
        config = model_config(num_layers=4, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
        stage = TinyLM(
            first_layer=pp_rank * LAYERS_PER_STAGE,
            last_layer=(pp_rank + 1) * LAYERS_PER_STAGE,
            pre_process=pp_rank == 0,
            post_process=pp_rank == 1,
            tie=True,
        )
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**layout), stage)
        config.no_sync_func = ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(_opt_config(ddp.ddp_config.use_distributed_optimizer), [ddp])
        norms = []
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            tokens, labels = (t.chunk(dp_size)[dp_rank] for t in make_batch(GLOBAL_BATCH, seed=step))
            micro = zip(tokens.chunk(MICROBATCHES), labels.chunk(MICROBATCHES))
            get_forward_backward_func()(
                forward_step_func=_forward_step,
                data_iterator=micro,
                model=[ddp],
                num_microbatches=MICROBATCHES,
                seq_length=SEQ,
                micro_batch_size=micro_batch_size,
            )
            norms.append(optimizer.step()[1])
        final = {_stage_name_in_full_model(k, pp_rank): v.float() for k, v in ddp.state_dict().items()}
        results[name] = (
            max_relative_error(final, expected),
            max(abs(a - b) / b for a, b in zip(norms, reference_norms)),
            sorted(final),
        )
    return results


def test_pipeline_parallel_with_data_parallel_matches_single_process():
    for rank, results in enumerate(run_distributed(4, _pipeline_and_data_parallel)):
        for layout, (weight_error, norm_error, names) in results.items():
            assert weight_error < 1e-5, f"PP=2 DP=2 {layout} rank {rank}: weights off by {weight_error:.2e}"
            assert norm_error < 1e-5, f"PP=2 DP=2 {layout} rank {rank}: grad norm off by {norm_error:.2e}"
            assert ("embedding.weight" in names) and (("norm.weight" in names) == (rank >= 2))
