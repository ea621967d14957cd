"""Training steps and checkpoints across context-parallel layouts.

Four ranks train the same GPT (Llama-like: RoPE, GQA, SwiGLU) with DDP, finalize_model_grads and the distributed
optimizer on the same global batches at CP1 x DP4, CP2 x DP2 and CP4: each CP rank of a data-parallel replica reads
the same micro-batches and keeps its ``get_batch_on_this_cp_rank`` split. One Adam step each. The loss mask drops
random tokens, so the
CP ranks hold different token counts: with ``calculate_per_token_loss`` the gradients are summed over DP x CP and
divided by the token count reduced over the same group, which is exact, and the step's loss and the updated
weights must match CP1. A checkpoint saved at CP4 then loads at CP1 with the weights unchanged, and the next
step after the load gives the loss of continuing at CP4.
"""

import torch
import torch.distributed as dist

from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.utils import get_batch_on_this_cp_rank
from tests.unit_tests.models.gpt_test_helpers import BATCH, SEQ, VARIANTS, VOCAB, build_config
from tests.unit_tests.test_utilities import run_distributed

GLOBAL_MICROBATCHES = 4
TOLERANCE = 1e-5
# Adam's first step moves every weight by about lr * sign(grad), so a gradient entry near zero turns fp32 rounding
# of the reductions into a visible difference; a missing or doubled reduction moves weights by ~lr (1e-2) instead.
WEIGHT_TOLERANCE = 1e-4


def _build(cp: int, seed: int):
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    model_parallel_cuda_manual_seed(seed)
    overrides = {
        **VARIANTS["llama"]["config"],
        "context_parallel_size": cp,
        "calculate_per_token_loss": True,
        "finalize_model_grads_func": finalize_model_grads,
    }
    config = build_config(1, False, overrides)
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ, **VARIANTS["llama"]["model"]
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [ddp])
    return ddp, optimizer


def _microbatches(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    return [
        {
            "tokens": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            "loss_mask": (torch.rand(BATCH, SEQ, generator=generator) > 0.3).float(),
            "position_ids": torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ),
        }
        for _ in range(GLOBAL_MICROBATCHES)
    ]


def _forward_step(data_iterator, model):
    batch = get_batch_on_this_cp_rank(next(data_iterator), is_hybrid_cp=False)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = (output_tensor.float() * batch["loss_mask"]).sum()
        num_tokens = batch["loss_mask"].sum().to(torch.int64)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    return output, loss_func


def _train(ddp, optimizer, steps):
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    per_rank = GLOBAL_MICROBATCHES // dp_size
    losses = []
    for step in steps:
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        batches = _microbatches(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        reduced = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(batches),
            model=[ddp],
            num_microbatches=per_rank,
            seq_length=SEQ,
            micro_batch_size=BATCH,
        )
        assert optimizer.step()[0]
        totals = torch.stack([item["lm loss"] for item in reduced]).sum(dim=0)
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        losses.append((totals[0] / totals[1]).item())
    ddp.state_dict()  # completes a pending parameter all-gather
    return losses


def _weights(ddp):
    return {name: param.detach().clone() for name, param in ddp.module.named_parameters()}


def _state_dict(ddp, optimizer, is_loading=False):
    state = {"model": ddp.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading)
    return state


def _train_at_each_cp_then_move_a_checkpoint(directory):
    results = {}
    for cp in (1, 2, 4):
        ddp, optimizer = _build(cp, seed=1)
        results[cp] = {"losses": _train(ddp, optimizer, [0]), "weights": _weights(ddp)}
    # ddp/optimizer are CP4's now: save, and remember how training would have continued.
    dist_checkpointing.save(_state_dict(ddp, optimizer), directory)
    continued = _train(ddp, optimizer, [1])
    ddp, optimizer = _build(1, seed=2)
    loaded = dist_checkpointing.load(_state_dict(ddp, optimizer, is_loading=True), directory)
    ddp.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    after_load = {"weights": _weights(ddp), "losses": _train(ddp, optimizer, [1]), "continued": continued}
    return results, after_load


def _relative(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_training_and_checkpoints_do_not_depend_on_context_parallelism(tmp_path):
    (tmp_path / "cp4").mkdir()
    for results, after_load in run_distributed(4, _train_at_each_cp_then_move_a_checkpoint, tmp_path / "cp4"):
        reference = results[1]
        for cp in (2, 4):
            for got, expected in zip(results[cp]["losses"], reference["losses"]):
                assert abs(got - expected) <= TOLERANCE * abs(expected), f"CP{cp} loss {got} vs {expected}"
            for name, weight in reference["weights"].items():
                error = _relative(results[cp]["weights"][name], weight)
                assert error <= WEIGHT_TOLERANCE, f"CP{cp} {name}: relative error {error:.2e}"
        for name, weight in results[4]["weights"].items():
            assert torch.equal(after_load["weights"][name], weight), f"{name} changed in the CP4 -> CP1 checkpoint"
        (loaded_loss,), (continued_loss,) = after_load["losses"], after_load["continued"]
        assert abs(loaded_loss - continued_loss) <= TOLERANCE * abs(continued_loss)
