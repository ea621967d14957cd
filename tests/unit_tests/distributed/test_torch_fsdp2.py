"""torch FSDP2 (TorchFullyShardedDataParallel): the same losses and gradients as plain DDP, at DP=2 and TP2 x DP2,
with and without resharding after forward; checkpoints that move between FSDP2 and DDP at another DP size; the
configurations it refuses."""

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.utils import to_local_if_dtensor
from tests.unit_tests.models import gpt_test_helpers as gpt
from tests.unit_tests.test_utilities import run_distributed

STEPS, GLOBAL_BATCH, MICROBATCHES = 2, 8, 2  # two micro-batches per rank up to DP4

# SwiGLU (its fc1 is stored as two tensors), RMSNorm, rotary, grouped-query attention, untied output layer.
LLAMA_UNTIED = dict(
    normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, num_query_groups=4, add_bias_linear=False
)


def _build(tp: int, seed: int = 1234) -> GPTModel:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)
    config = gpt.build_config(tp, tp > 1, LLAMA_UNTIED)
    return GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=gpt.VOCAB,
        max_sequence_length=gpt.SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def _wrap(model: GPTModel, fsdp2: bool, reshard: bool = True):
    if fsdp2:
        config = TorchFullyShardedDataParallelConfig(reshard_after_forward=reshard)
        return TorchFullyShardedDataParallel(model.config, config, model)
    return DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)


def _optimizer(wrapped):
    return get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5), [wrapped])


def _microbatches(step: int):
    """This DP rank's micro-batches of step ``step``'s global batch."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, gpt.VOCAB, (GLOBAL_BATCH, gpt.SEQ), generator=generator)
    labels = torch.randint(0, gpt.VOCAB, (GLOBAL_BATCH, gpt.SEQ), generator=generator)
    positions = torch.arange(gpt.SEQ).expand(GLOBAL_BATCH, gpt.SEQ)
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    local = [t.chunk(size)[rank] for t in (tokens, positions, labels)]
    return list(zip(*(t.chunk(MICROBATCHES) for t in local)))


def _train_step(wrapped, optimizer, step: int):
    """One step over the micro-batches (all but the last under no_sync); the DP-mean loss, the full gradients
    (gathered over DP and TP) and the gradient norm."""
    wrapped.zero_grad_buffer()
    optimizer.zero_grad()
    micro = _microbatches(step)
    total = torch.zeros(())
    for index, (tokens, positions, labels) in enumerate(micro):
        last = index == len(micro) - 1
        with contextlib.nullcontext() if last else wrapped.no_sync():
            loss = wrapped(tokens, positions, None, labels=labels).mean() / len(micro)
            loss.backward()
        total += loss.detach()
    finalize_model_grads([wrapped])
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    grads = _full_grads(wrapped.module)
    _, grad_norm, _ = optimizer.step()
    return (total / parallel_state.get_data_parallel_world_size()).item(), grads, grad_norm


def _full_grads(model) -> dict:
    grads = {}
    for name, param in model.named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name] = gpt.gather_tensor_parallel(grad.detach().clone(), param)
    return grads


def _ddp_and_fsdp2_runs(tp: int, reshard: bool):
    results = {}
    for fsdp2 in (False, True):
        wrapped = _wrap(_build(tp), fsdp2, reshard)
        optimizer = _optimizer(wrapped)
        results[fsdp2] = [_train_step(wrapped, optimizer, step) for step in range(STEPS)]
    return results[False], results[True]


@pytest.mark.parametrize("tp, dp, reshard", [(1, 2, True), (1, 2, False), (2, 2, True), (1, 4, True)])
def test_fsdp2_matches_ddp_losses_and_every_gradient(tp, dp, reshard):
    for rank, (ddp, fsdp2) in enumerate(run_distributed(tp * dp, _ddp_and_fsdp2_runs, tp, reshard)):
        for step, ((ddp_loss, ddp_grads, ddp_norm), (loss, grads, norm)) in enumerate(zip(ddp, fsdp2)):
            what = f"TP{tp} x DP{dp} reshard={reshard} rank {rank} step {step}"
            assert loss == pytest.approx(ddp_loss, rel=1e-5), what
            assert norm == pytest.approx(ddp_norm, rel=1e-5), what
            gpt.assert_close_dicts(grads, ddp_grads, tolerance=1e-5, what=what)


def _fsdp2_params_are_dtensor_shards():
    wrapped = _wrap(_build(1), fsdp2=True)
    layer_weight = wrapped.module.decoder.layers[0].mlp.linear_fc2.weight
    return (
        type(layer_weight).__name__,
        tuple(layer_weight.shape),
        tuple(layer_weight.to_local().shape),
        type(wrapped.module.decoder.layers[0]).__name__,
    )


def test_fsdp2_shards_each_transformer_layer_over_data_parallel_ranks():
    for kind, global_shape, local_shape, layer_class in run_distributed(2, _fsdp2_params_are_dtensor_shards):
        assert kind == "DTensor"
        assert local_shape == (global_shape[0] // 2, global_shape[1])
        assert layer_class.startswith("FSDP")  # fully_shard was applied to the layer itself


def _bytes_held_after_a_step(fsdp2: bool):
    """(parameters, gradients, optimizer state) bytes this rank holds after a step, summed from the real tensors."""
    wrapped = _wrap(_build(1), fsdp2)
    optimizer = _optimizer(wrapped)
    _train_step(wrapped, optimizer, 0)
    with torch.no_grad():
        params = list(wrapped.module.parameters())
        param_bytes = sum(to_local_if_dtensor(p).numel() * p.element_size() for p in params)
        if fsdp2:
            grad_bytes = sum(to_local_if_dtensor(p.grad).numel() * p.grad.element_size() for p in params)
        else:
            grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in wrapped.buffers)
        state_bytes = sum(
            to_local_if_dtensor(v).numel() * v.element_size()
            for state in optimizer.optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
    return param_bytes, grad_bytes, state_bytes


def test_fsdp2_holds_one_data_parallel_share_of_parameters_gradients_and_optimizer_state():
    ddp = run_distributed(4, _bytes_held_after_a_step, False)
    fsdp2 = run_distributed(4, _bytes_held_after_a_step, True)
    for rank in range(4):
        # fp32 with Adam: 4 + 4 + 8 = 16 bytes per parameter under DDP, 16 / DP under FSDP2 (every dim divides by 4).
        assert [b * 4 for b in fsdp2[rank]] == list(ddp[rank]), f"rank {rank}: {fsdp2[rank]} vs {ddp[rank]}"
        assert ddp[rank][2] == 2 * ddp[rank][0]


def _gather_after_regrouping():
    """Wrap, re-create the process groups, wrap again: the second wrapper's DTensors must use the new group."""
    sums = []
    for _ in range(2):
        wrapped = _wrap(_build(1), fsdp2=True)
        sums.append(wrapped.module.output_layer.weight.full_tensor().sum().item())
    return sums


def test_a_wrapper_built_after_the_groups_are_recreated_uses_the_new_group():
    for first, second in run_distributed(2, _gather_after_regrouping):
        assert first == second


# ---- checkpoints across DDP <-> FSDP2 ---------------------------------------------------------------------------


def _save_after_one_step(fsdp2: bool, tp: int, checkpoint: str):
    wrapped = _wrap(_build(tp), fsdp2)
    optimizer = _optimizer(wrapped)
    _train_step(wrapped, optimizer, 0)
    model_state = wrapped.sharded_state_dict()
    state = {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state)}
    dist_checkpointing.save(state, checkpoint)
    return _train_step(wrapped, optimizer, 1)[0]


def _resume_and_step(fsdp2: bool, tp: int, checkpoint: str):
    wrapped = _wrap(_build(tp, seed=99), fsdp2)  # other weights: everything must come from the checkpoint
    optimizer = _optimizer(wrapped)
    model_state = wrapped.sharded_state_dict()
    template = {"model": model_state, "optimizer": optimizer.sharded_state_dict(model_state, is_loading=True)}
    loaded = dist_checkpointing.load(template, checkpoint)
    wrapped.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    return _train_step(wrapped, optimizer, 1)[0]


@pytest.mark.parametrize(
    "save, load",
    [
        ((True, 1, 2), (False, 1, 4)),  # FSDP2 at DP2 -> DDP at DP4
        ((False, 1, 2), (True, 1, 4)),  # DDP at DP2 -> FSDP2 at DP4
        ((True, 2, 2), (True, 1, 2)),  # FSDP2 TP2 x DP2 -> FSDP2 DP2
        ((False, 2, 1), (True, 2, 2)),  # DDP TP2 -> FSDP2 TP2 x DP2
    ],
)
def test_checkpoint_moves_between_ddp_and_fsdp2_at_another_layout(tmp_path, save, load):
    (save_fsdp2, save_tp, save_dp), (load_fsdp2, load_tp, load_dp) = save, load
    expected = run_distributed(save_tp * save_dp, _save_after_one_step, save_fsdp2, save_tp, str(tmp_path))[0]
    for loss in run_distributed(load_tp * load_dp, _resume_and_step, load_fsdp2, load_tp, str(tmp_path)):
        assert loss == pytest.approx(expected, rel=1e-5)


# ---- what FSDP2 refuses -----------------------------------------------------------------------------------------


def test_config_refuses_the_distributed_optimizer():
    with pytest.raises(ValueError, match="use_distributed_optimizer=True cannot be combined with torch FSDP2"):
        TorchFullyShardedDataParallelConfig(use_distributed_optimizer=True)


def test_config_refuses_a_bad_reshard_after_forward():
    with pytest.raises(ValueError, match="reshard_after_forward must be True, False or a positive number"):
        TorchFullyShardedDataParallelConfig(reshard_after_forward=0)


def _wrap_tied_model():
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    config = gpt.build_config(1, False, {})
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=gpt.VOCAB,
        max_sequence_length=gpt.SEQ,
        share_embeddings_and_output_weights=True,
    )
    try:
        TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), model)
    except ValueError as error:
        return str(error)
    return None


def test_tied_embeddings_are_refused_before_any_collective():
    for message in run_distributed(2, _wrap_tied_model):
        assert message is not None and "share_embeddings_and_output_weights=True" in message
        assert "--untie-embeddings-and-output-weights" in message


# ---- the command line -------------------------------------------------------------------------------------------

FSDP2_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--distributed-backend", "gloo",
    "--no-gradient-accumulation-fusion", "--untie-embeddings-and-output-weights", "--use-torch-fsdp2",
]  # fmt: skip


def _validated(*extra, world_size=4, base=FSDP2_ARGS):
    from megatron.training.arguments import parse_args_list, validate_args

    args = parse_args_list(list(base) + list(extra))
    args.world_size = world_size
    return validate_args(args, {})


def test_flags_reach_the_ddp_config():
    from megatron.training.model_setup import get_megatron_ddp_config

    config = get_megatron_ddp_config(_validated("--torch-fsdp2-no-reshard-after-forward"))
    assert isinstance(config, TorchFullyShardedDataParallelConfig) and config.reshard_after_forward is False
    assert get_megatron_ddp_config(_validated()).reshard_after_forward is True


@pytest.mark.parametrize(
    "extra, base, message",
    [
        (["--use-distributed-optimizer"], FSDP2_ARGS, "--use-torch-fsdp2 cannot be combined with --use-distributed-"),
        (["--pipeline-model-parallel-size", "2"], FSDP2_ARGS, "with --pipeline-model-parallel-size 2: use --pipeline"),
        (
            ["--num-experts", "4", "--expert-model-parallel-size", "2"],
            FSDP2_ARGS,
            "with --expert-model-parallel-size 2: use --expert-model-parallel-size 1",
        ),
        (["--ckpt-format", "torch"], FSDP2_ARGS, "with --ckpt-format torch: use --ckpt-format torch_dist"),
        (["--fp16"], FSDP2_ARGS, "--use-torch-fsdp2 cannot be combined with --fp16: use --bf16 or fp32"),
        (["--optimizer-cpu-offload"], FSDP2_ARGS, "with --optimizer-cpu-offload: the offloaded optimizer steps whole"),
        (["--optimizer", "muon"], FSDP2_ARGS, "with --optimizer muon: Newton-Schulz needs each matrix whole"),
        (
            [],
            [a for a in FSDP2_ARGS if a != "--untie-embeddings-and-output-weights"],
            "tied embedding and output weights (no --untie-embeddings-and-output-weights): FSDP2 cannot shard",
        ),
    ],
)
def test_incompatible_flags_are_refused_naming_both(extra, base, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _validated(*extra, base=base)
