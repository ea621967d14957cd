"""finalize_model_grads on plain modules and on chunks that look like our DDP (main_grad, finish_grad_sync)."""

import inspect
import types

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import (
    _allreduce_position_embedding_grads,
    _get_main_grad_attr,
    _update_router_qb_beta,
    finalize_model_grads,
    reset_model_temporary_tensors,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.test_utilities import Utils, run_distributed


class TiedStage(torch.nn.Module):
    """One pipeline stage of a model whose input embedding and output layer share a weight."""

    def __init__(self, tied: bool = True):
        super().__init__()
        self.share_embeddings_and_output_weights = tied
        self.word_embeddings = torch.nn.Parameter(torch.zeros(3, 2))
        self.norm = torch.nn.Parameter(torch.zeros(2))
        self.norm.sequence_parallel = True
        self.other = torch.nn.Parameter(torch.zeros(4))

    def shared_embedding_or_output_weight(self):
        return self.word_embeddings


class Wrapper(torch.nn.Module):
    """Stands for DDP / Float16Module: the real model sits in ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def _set_grads(module, value):
    for param in module.parameters():
        param.grad = torch.full_like(param, value)


def _tied_embedding_over_two_stages():
    Utils.initialize_model_parallel(pipeline_model_parallel_size=2)
    rank = dist.get_rank()
    tied, untied = TiedStage(tied=True), TiedStage(tied=False)
    _set_grads(tied, rank + 1.0)
    _set_grads(untied, rank + 1.0)
    finalize_model_grads([Wrapper(tied)])
    finalize_model_grads([untied])
    # A stage whose shared weight received no gradient still takes part (with zeros).
    no_grad_stage = TiedStage()
    no_grad_stage.word_embeddings.grad = None if rank == 0 else torch.full((3, 2), 5.0)
    finalize_model_grads(no_grad_stage)
    return (
        tied.word_embeddings.grad[0, 0].item(),
        tied.other.grad[0].item(),
        untied.word_embeddings.grad[0, 0].item(),
        no_grad_stage.word_embeddings.grad[0, 0].item(),
    )


def test_tied_embedding_grads_are_summed_over_first_and_last_stage():
    results = run_distributed(2, _tied_embedding_over_two_stages)
    # tied: 1 + 2 on both stages; untouched params keep their own grads; untied models are left alone.
    assert results == [(3.0, 1.0, 1.0, 5.0), (3.0, 2.0, 2.0, 5.0)]


def _sequence_parallel_grads_and_token_division():
    # 4 ranks: TP=2 x DP=2. Marked grads are summed over TP; with num_tokens every grad is divided by the DP total.
    Utils.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    stage = TiedStage(tied=False)
    _set_grads(stage, rank + 1.0)
    tp_partner_value = (rank ^ 1) + 1.0
    num_tokens = torch.tensor(rank + 1)  # DP groups are {0, 2} and {1, 3}
    finalize_model_grads([stage], num_tokens=num_tokens)
    return (
        stage.norm.grad[0].item(),
        (rank + 1.0 + tp_partner_value),
        stage.other.grad[0].item(),
        num_tokens.item(),
    )


def test_sequence_parallel_grads_summed_over_tp_and_divided_by_global_tokens():
    results = run_distributed(4, _sequence_parallel_grads_and_token_division)
    dp_token_total = {0: 1 + 3, 1: 2 + 4, 2: 1 + 3, 3: 2 + 4}
    for rank, (norm_grad, tp_sum, other_grad, total_tokens) in enumerate(results):
        assert total_tokens == dp_token_total[rank]
        assert norm_grad == pytest.approx(tp_sum / total_tokens)
        assert other_grad == pytest.approx((rank + 1.0) / total_tokens)


class FakeDDPChunk(torch.nn.Module):
    """Records the calls finalize_model_grads makes on a DDP-wrapped chunk; grads live in main_grad."""

    def __init__(self):
        super().__init__()
        self.module = TiedStage(tied=True)
        self.calls = []
        for param in self.module.parameters():
            param.main_grad = torch.ones_like(param)

    def finish_grad_sync(self, force_all_reduce=False):
        self.calls.append("finish_grad_sync" + (" (all-reduce)" if force_all_reduce else ""))

    def scale_gradients(self, factor):
        self.calls.append(("scale_gradients", float(factor)))
        for param in self.module.parameters():
            param.main_grad.mul_(factor)


def _ddp_like_chunks_on_pipeline():
    # PP=2 x DP=2 (ranks 0,1 first stage; 2,3 last stage); only the last stage counts tokens.
    Utils.initialize_model_parallel(pipeline_model_parallel_size=2)
    rank = dist.get_rank()
    chunk = FakeDDPChunk()
    last_stage = parallel_state.is_pipeline_last_stage()
    num_tokens = torch.tensor(10 if last_stage else 999)
    finalize_model_grads([chunk], num_tokens=num_tokens)
    weight = chunk.module.word_embeddings
    return rank, chunk.calls, weight.main_grad[0, 0].item(), weight.grad, num_tokens.item()


def test_ddp_chunks_use_main_grad_and_their_own_sync_and_scaling():
    for rank, calls, embedding_grad, plain_grad, num_tokens in run_distributed(4, _ddp_like_chunks_on_pipeline):
        assert num_tokens == 20, f"rank {rank}: the last stage's count summed over its 2 DP ranks"
        assert calls == ["finish_grad_sync", ("scale_gradients", pytest.approx(1 / 20))]
        assert embedding_grad == pytest.approx(2 / 20), "tied main_grads summed over the two stages, then divided"
        assert plain_grad is None


def _zero_tokens_leave_grads_alone():
    Utils.initialize_model_parallel()
    stage = TiedStage(tied=False)
    _set_grads(stage, 3.0)
    finalize_model_grads(stage, num_tokens=torch.tensor(0))
    with pytest.raises(TypeError, match="num_tokens must be a tensor.*got int"):
        finalize_model_grads(stage, num_tokens=4)
    return stage.other.grad[0].item()


def test_empty_batch_keeps_grads_and_int_token_count_is_rejected():
    assert run_distributed(1, _zero_tokens_leave_grads_alone) == [3.0]


def test_force_all_reduce_reaches_the_chunks():
    chunk = FakeDDPChunk()
    no_groups = ProcessGroupCollection(tp=None, pp=None, embd=None, pos_embd=None, dp_cp=None)  # one process
    finalize_model_grads([chunk], pg_collection=no_groups, force_all_reduce=True)
    assert chunk.calls == ["finish_grad_sync (all-reduce)"]


class _Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.expert_bias = torch.zeros(2)
        self.local_tokens_per_expert = torch.tensor([3.0, 5.0])
        self.tracker_resets = 0

    def reset_global_aux_loss_tracker(self):
        self.tracker_resets += 1


def test_reset_model_temporary_tensors_clears_router_statistics():
    router = _Router()
    chunk = torch.nn.Sequential(torch.nn.Linear(2, 2), router)
    config = types.SimpleNamespace(moe_router_enable_expert_bias=False, moe_router_load_balancing_type="aux_loss")
    reset_model_temporary_tensors(config, [chunk])
    assert router.local_tokens_per_expert.tolist() == [3.0, 5.0] and router.tracker_resets == 0
    config = types.SimpleNamespace(
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss,global_aux_loss"
    )
    reset_model_temporary_tensors(config, [chunk])
    assert router.local_tokens_per_expert.tolist() == [0.0, 0.0] and router.tracker_resets == 1


class _PositionEmbeddingStage(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.position_embeddings = torch.nn.Embedding(4, 2)
        self.embedding.position_embeddings.weight.grad = torch.full((4, 2), value)


def _position_embeddings_summed():
    Utils.initialize_model_parallel()
    rank = dist.get_rank()
    stage = _PositionEmbeddingStage(float(rank + 1))
    everyone = dist.new_group([0, 1])
    single = parallel_state.get_tensor_model_parallel_group()  # a group of one rank
    _allreduce_position_embedding_grads([stage], None, everyone, single)
    summed = stage.embedding.position_embeddings.weight.grad[0, 0].item()
    _allreduce_position_embedding_grads([stage], None, single, single)  # one stage in the group: nothing to do
    return summed, stage.embedding.position_embeddings.weight.grad[0, 0].item()


def test_position_embedding_grads_are_summed_over_their_group():
    for summed, untouched in run_distributed(2, _position_embeddings_summed):
        assert summed == 3.0 and untouched == 3.0


def test_main_grad_attr():
    param = torch.nn.Parameter(torch.zeros(1))
    assert _get_main_grad_attr(param) == "grad"
    param.main_grad = torch.zeros(1)
    assert _get_main_grad_attr(param) == "main_grad"


class _BiasedRouter(torch.nn.Module):
    """What finalize_model_grads reads from a router with aux-loss-free balancing: its bias and token counts."""

    def __init__(self, tokens):
        super().__init__()
        self.register_buffer("expert_bias", torch.tensor([0.5, 0.0, -0.5, 0.0]))
        self.register_buffer("local_tokens_per_expert", torch.tensor(tokens, dtype=torch.float32))


class _MoEChunk(torch.nn.Module):
    def __init__(self, tokens_by_router):
        super().__init__()
        self.config = types.SimpleNamespace(
            moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1, moe_router_load_balancing_type="none"
        )
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.weight.grad = torch.zeros(2)
        self.routers = torch.nn.ModuleList(_BiasedRouter(tokens) for tokens in tokens_by_router)


def _expert_biases_after_one_step():
    Utils.initialize_model_parallel()  # 2 data-parallel ranks: token counts are summed over TP x DP x CP
    rank = dist.get_rank()
    per_rank = {0: [[3, 5, 0, 0], [2, 2, 2, 2]], 1: [[1, 1, 4, 2], [0, 0, 0, 8]]}[rank]
    chunk = _MoEChunk(per_rank)
    finalize_model_grads([chunk])
    return [(r.expert_bias.tolist(), r.local_tokens_per_expert.tolist()) for r in chunk.routers]


def test_expert_bias_update_matches_a_hand_computation():
    # Router 0: summed counts [4, 6, 4, 2], mean 4 -> signs [0, -1, 0, +1]; router 1: [2, 2, 2, 10], mean 4 ->
    # [+1, +1, +1, -1]; each bias moves by 0.1 times its sign, and the counts are cleared for the next step.
    expected = [([0.5, -0.1, -0.5, 0.1], [0.0] * 4), ([0.6, 0.1, -0.4, -0.1], [0.0] * 4)]
    for routers in run_distributed(2, _expert_biases_after_one_step):
        for (bias, tokens), (expected_bias, expected_tokens) in zip(routers, expected):
            assert bias == pytest.approx(expected_bias) and tokens == expected_tokens


def test_update_router_qb_beta_has_megatrons_signature_and_is_a_no_op_without_quantile_balancing():
    assert list(inspect.signature(_update_router_qb_beta).parameters) == ["model", "config", "dp_cp_group"]
    router = _Router()
    chunk = torch.nn.Sequential(torch.nn.Linear(2, 2), router)
    config = types.SimpleNamespace(moe_router_quantile_balancing_ema=0.0)
    before = [p.clone() for p in chunk.parameters()]
    _update_router_qb_beta([chunk], config)  # no router accumulates qb_beta: nothing to update, no collective
    assert all(torch.equal(a, b) for a, b in zip(before, chunk.parameters()))


def test_update_router_qb_beta_refuses_a_quantile_balancing_router():
    router = _Router()
    router.qb_beta, router.qb_beta_accum, router.qb_beta_count = torch.zeros(2), torch.ones(2), torch.ones(1)
    chunk = torch.nn.Sequential(torch.nn.Linear(2, 2), router)
    with pytest.raises(ValueError, match=r"not supported yet: MoE quantile balancing \(modules \['1'\] carry"):
        _update_router_qb_beta([chunk], types.SimpleNamespace(moe_router_quantile_balancing_ema=0.9))
    chunk.eval()  # Megatron updates only modules in training mode
    _update_router_qb_beta([chunk], types.SimpleNamespace(moe_router_quantile_balancing_ema=0.9))
