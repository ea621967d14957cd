"""Expert parallelism in DDP, the optimizers and the gradient statistics: EP=2/4 (with expert-DP 1 and 2) reach the
EP=1 single-process result.

``ToyMoE`` is a language model whose middle is ``NUM_EXPERTS`` expert MLPs marked ``allreduce=False``, with a fixed
routing (token id modulo the expert count) so that routing is the same at every layout. Under EP each rank holds
``NUM_EXPERTS / EP`` experts (weights keyed by global expert index) and exchanges tokens with the other EP ranks by
an all-gather / all-reduce pair whose backward is the matching reduction, which is what a real dispatcher's
all-to-all amounts to for the gradients. Every rank also trains the single-process reference itself, so one
multi-rank run checks every layout against it: gradients after DDP (each expert by its global index), weights after
several Adam steps with clipping (plain DDP, overlapped buckets, the distributed optimizer), the clipped gradient
norm, the zero count and the parameter norm.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training.utils import calc_params_l2_norm
from tests.unit_tests.distributed.ddp_test_helpers import VOCAB, make_batch, max_relative_error, wrap
from tests.unit_tests.test_utilities import Utils, run_distributed

HIDDEN, NUM_EXPERTS, STEPS, GLOBAL_BATCH, MICROBATCHES = 16, 4, 3, 8, 2


class _GatherFromGroup(torch.autograd.Function):
    """All-gather along dim 0; backward sums the gradients of every rank and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group, ctx.rows = group, tensor.shape[0]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows : (rank + 1) * ctx.rows], None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum); every rank uses the sum, so the gradient is the sum of every rank's gradient."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ToyMoE(torch.nn.Module):
    """Embedding -> one routed expert MLP per token (id % experts) -> LayerNorm -> output layer; ``ep_group``
    None builds the single-process reference (every expert here, nothing marked expert-parallel)."""

    def __init__(self, ep_size: int = 1, ep_rank: int = 0, ep_group=None, seed: int = 1234):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN, _weight=torch.randn(VOCAB, HIDDEN, generator=generator))
        all_experts = [
            (
                torch.randn(2 * HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5,
                torch.randn(HIDDEN, 2 * HIDDEN, generator=generator) / (2 * HIDDEN) ** 0.5,
            )
            for _ in range(NUM_EXPERTS)
        ]
        self.output = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        per_rank = NUM_EXPERTS // ep_size
        self.local_expert_ids = list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
        self.experts = torch.nn.ParameterList()
        for expert in self.local_expert_ids:
            for weight in all_experts[expert]:
                param = torch.nn.Parameter(weight.clone())
                # The single-process reference (ep_group None) is a plain model: nothing is expert-parallel there.
                param.allreduce = ep_group is None
                self.experts.append(param)
        self.ep_size, self.ep_group = ep_size, ep_group

    def forward(self, tokens, labels):
        ids = tokens.t().reshape(-1)
        hidden = self.embedding(ids)
        # Under EP every rank sees the tokens of the whole EP group and computes its own experts' share of them.
        hidden_all, ids_all = hidden, ids
        if self.ep_size > 1:
            hidden_all = _GatherFromGroup.apply(hidden, self.ep_group)
            id_parts = [torch.empty_like(ids) for _ in range(self.ep_size)]
            dist.all_gather(id_parts, ids, group=self.ep_group)
            ids_all = torch.cat(id_parts)
        routed = torch.zeros_like(hidden_all)
        for slot, expert in enumerate(self.local_expert_ids):
            mask = (ids_all % NUM_EXPERTS == expert).unsqueeze(-1)
            fc1, fc2 = self.experts[2 * slot], self.experts[2 * slot + 1]
            routed = routed + mask * F.linear(F.gelu(F.linear(hidden_all, fc1)), fc2)
        if self.ep_size > 1:
            rank = dist.get_rank(self.ep_group)
            routed = _SumOverGroup.apply(routed, self.ep_group)[rank * ids.numel() : (rank + 1) * ids.numel()]
        logits = F.linear(self.norm(hidden + routed), self.output)
        return F.cross_entropy(logits.float(), labels.t().reshape(-1))


def _expert_grads_by_global_index(model: ToyMoE, attr: str):
    grads = {}
    for slot, expert in enumerate(model.local_expert_ids):
        for which in (0, 1):
            grads[(expert, which)] = getattr(model.experts[2 * slot + which], attr).clone()
    return grads


def _opt_config(distributed: bool) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        weight_decay=0.1,
        clip_grad=0.3,
        use_distributed_optimizer=distributed,
        log_num_zeros_in_grad=True,
    )


def _train(model, optimizer, ddp_model=None, dp_rank=0, dp_size=1):
    """STEPS steps on the global batches (this DP rank's slice); the gradients of the first step (before the
    optimizer touches them), and the (grad norm, zero count) of every step."""
    first_grads, stats = None, []
    for step in range(STEPS):
        if ddp_model is not None:
            ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, labels = make_batch(GLOBAL_BATCH, seed=step)
        tokens, labels = tokens.chunk(dp_size)[dp_rank], labels.chunk(dp_size)[dp_rank]
        micro = list(zip(tokens.chunk(MICROBATCHES), labels.chunk(MICROBATCHES)))
        for index, (tok, lab) in enumerate(micro):
            last = index == len(micro) - 1
            sync = contextlib.nullcontext() if (last or ddp_model is None) else ddp_model.no_sync()
            with sync:
                ((ddp_model or model)(tok, lab) / MICROBATCHES).backward()
        if ddp_model is not None:
            finalize_model_grads([ddp_model], force_all_reduce=step == 0)
        if step == 0:
            first_grads = _expert_grads_by_global_index(model, "grad" if ddp_model is None else "main_grad")
        _, grad_norm, num_zeros = optimizer.step()
        stats.append((grad_norm, num_zeros))
    return first_grads, stats


def _global_weights(model: ToyMoE):
    named = {name: p.detach().clone() for name, p in model.named_parameters() if not name.startswith("experts")}
    named.update({f"expert{e}.{w}": g for (e, w), g in _expert_grads_by_global_index(model, "data").items()})
    return named


LAYOUTS = {
    "plain": dict(),
    "overlap": dict(overlap_grad_reduce=True, bucket_size=200),
    "distopt": dict(use_distributed_optimizer=True),
    "distopt+overlap": dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=200),
}


def _every_layout_matches_ep1(ep_size):
    Utils.initialize_model_parallel(expert_model_parallel_size=ep_size)
    reference = ToyMoE()
    reference_grads, reference_stats = _train(reference, get_megatron_optimizer(_opt_config(False), [reference]))
    reference_weights = _global_weights(reference)
    reference_params_norm = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).norm().item()

    ep_group = parallel_state.get_expert_model_parallel_group()
    dp_group = parallel_state.get_data_parallel_group()
    results = {}
    for name, layout in LAYOUTS.items():
        module = ToyMoE(ep_size, dist.get_rank(ep_group), ep_group)
        ddp_config = DistributedDataParallelConfig(**layout)
        ddp_model = wrap(module, ddp_config)
        optimizer = get_megatron_optimizer(_opt_config(ddp_config.use_distributed_optimizer), [ddp_model])
        grads, stats = _train(module, optimizer, ddp_model, dist.get_rank(dp_group), dist.get_world_size(dp_group))
        grad_error = max(
            ((grads[key] - reference_grads[key]).norm() / reference_grads[key].norm()).item() for key in grads
        )
        norm_error = max(abs(a[0] - b[0]) / b[0] for a, b in zip(stats, reference_stats))
        zeros = [s[1] for s in stats]
        ddp_model.state_dict()  # completes a pending parameter all-gather
        weights = _global_weights(module)
        weight_error = max_relative_error(weights, {k: reference_weights[k] for k in weights})
        params_norm_error = abs(calc_params_l2_norm([ddp_model]) - reference_params_norm) / reference_params_norm
        results[name] = dict(
            grad=grad_error,
            norm=norm_error,
            weights=weight_error,
            params_norm=params_norm_error,
            zeros=zeros,
            reference_zeros=[s[1] for s in reference_stats],
            expert_dp=dist.get_world_size(parallel_state.get_expert_data_parallel_group()),
            optimizers=[type(opt).__name__ for opt in optimizer.chained_optimizers],
        )
    return results


@pytest.mark.parametrize("world_size,ep_size", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_training_matches_ep1(world_size, ep_size):
    for rank, results in enumerate(run_distributed(world_size, _every_layout_matches_ep1, ep_size)):
        for layout, r in results.items():
            where = f"EP={ep_size} of {world_size} ranks, {layout}, rank {rank}"
            assert r["expert_dp"] == world_size // ep_size, where
            assert r["grad"] < 1e-5, f"{where}: expert gradients after DDP off by {r['grad']:.2e}"
            assert r["norm"] < 1e-5, f"{where}: clipped grad norm off by {r['norm']:.2e}"
            assert r["weights"] < 1e-5, f"{where}: weights after {STEPS} steps off by {r['weights']:.2e}"
            assert r["params_norm"] < 1e-5, f"{where}: params norm off by {r['params_norm']:.2e}"
            assert r["zeros"] == r["reference_zeros"], f"{where}: zero counts {r['zeros']}"
            expected = "DistributedOptimizer" if "distopt" in layout else "FP32Optimizer"
            assert r["optimizers"] == [expected, expected], where
