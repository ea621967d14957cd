"""DDP API that Megatron-Core 0.19 adds: force_all_reduce, force_dispatch / reset of parameter gathers, gradient
buffer offload, buffer grouping and bucket-group partitioning, refused options."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer.param_layout import FullParamLayout
from megatron.core.distributed.param_and_grad_buffer import (
    BufferKey,
    BufferType,
    group_params_for_buffers,
    partition_buckets,
)
from tests.unit_tests.distributed.ddp_test_helpers import TinyLM, make_batch, model_config, wrap
from tests.unit_tests.test_utilities import Utils, run_distributed


def _local_batch(rank):
    tokens, labels = make_batch(4)
    return tokens.chunk(2)[rank], labels.chunk(2)[rank]


def _force_all_reduce(overlap: bool):
    """With the distributed optimizer, force_all_reduce leaves every rank the full averaged gradient."""
    Utils.initialize_model_parallel()
    rank = dist.get_rank()
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap, bucket_size=200)
    model = wrap(TinyLM(), config)
    model.zero_grad_buffer()
    model(*_local_batch(rank)).backward()
    finalize_model_grads([model], force_all_reduce=True)
    grads = {name: p.main_grad.clone() for name, p in model.module.named_parameters()}
    reference = TinyLM()
    tokens, labels = make_batch(4)
    # The mean over the two local batches' losses, as DDP averages the two ranks' gradients.
    sum(reference(tok, lab) for tok, lab in zip(tokens.chunk(2), labels.chunk(2))).div(2).backward()
    return max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())


@pytest.mark.parametrize("overlap", [False, True])
def test_force_all_reduce_gives_every_rank_the_full_gradient(overlap):
    for error in run_distributed(2, _force_all_reduce, overlap):
        assert error < 1e-6


def _param_gather_dispatch():
    Utils.initialize_model_parallel()
    rank = dist.get_rank()
    model = wrap(TinyLM(), DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True))
    group = model.bucket_groups[0]
    data = group.buckets[0].param_data
    shard = data.numel() // 2

    def set_my_shard(value):
        data[rank * shard : (rank + 1) * shard] = value  # what an optimizer step does to this rank's shard

    def shards():
        group.finish_param_sync(skip_next_bucket_dispatch=True)  # what the forward pre-hook waits for
        return data[:shard].unique().tolist(), data[shard:].unique().tolist()

    set_my_shard(float(rank + 1))
    model.start_param_sync()
    first = shards()
    set_my_shard(float(rank + 3))
    model.start_param_sync()  # already dispatched this step: nothing is gathered
    skipped = shards()
    model.start_param_sync(force_dispatch=True)  # gathered again
    forced = shards()
    set_my_shard(float(rank + 5))
    model.reset_param_sync_dispatch_state()
    model.start_param_sync()  # dispatched again after the reset
    after_reset = shards()
    return first, skipped, forced, after_reset


def test_force_dispatch_and_reset_gather_parameters_again():
    for rank, (first, skipped, forced, after_reset) in enumerate(run_distributed(2, _param_gather_dispatch)):
        assert first == ([1.0], [2.0])
        # The other rank's shard still holds the first gather; only the own shard changed locally.
        assert skipped == (([3.0], [2.0]) if rank == 0 else ([1.0], [4.0]))
        assert forced == ([3.0], [4.0])
        assert after_reset == ([5.0], [6.0])


def _free_overlap_buffers():
    Utils.initialize_model_parallel()
    rank = dist.get_rank()
    model = wrap(TinyLM(), DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_param_gather=True))
    data = model.bucket_groups[0].buckets[0].param_data
    shard = data.numel() // 2
    data[rank * shard : (rank + 1) * shard] = float(rank + 1)
    model.start_param_sync()  # asynchronous with overlap_param_gather
    in_flight = sum(len(group.param_gather_handles) for group in model.bucket_groups)
    model.free_overlap_buffers()
    left = sum(len(group.param_gather_handles) for group in model.bucket_groups)
    return in_flight, left, data[:shard].unique().tolist(), data[shard:].unique().tolist()


def test_free_overlap_buffers_completes_in_flight_gathers():
    for in_flight, left, first, second in run_distributed(2, _free_overlap_buffers):
        assert in_flight > 0 and left == 0
        assert (first, second) == ([1.0], [2.0])


def _offload_and_restore():
    Utils.initialize_model_parallel()
    rank = dist.get_rank()
    model = wrap(TinyLM(), DistributedDataParallelConfig())
    buffer = model.buffers[0]
    model.zero_grad_buffer()
    model(*_local_batch(rank)).backward()
    model.finish_grad_sync()
    first = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
    model.offload_grad_buffers()
    offloaded_bytes = buffer.grad_data.untyped_storage().nbytes()
    model.restore_grad_buffers()
    restored_zero = bool((buffer.grad_data == 0).all())
    model.zero_grad_buffer()
    model(*_local_batch(rank)).backward()  # the same step again lands in the restored buffer
    model.finish_grad_sync()
    same = all(torch.equal(first[n], p.main_grad) for n, p in model.module.named_parameters())
    return offloaded_bytes, restored_zero, same


def test_grad_buffers_offload_and_restore():
    for offloaded_bytes, restored_zero, same in run_distributed(2, _offload_and_restore):
        assert offloaded_bytes == 0 and restored_zero and same


def _single_bucket_group():
    Utils.initialize_model_parallel()
    module = TinyLM()
    module.layers[0].half()  # a second buffer (fp16 parameters)
    model = DistributedDataParallel(
        model_config(),
        DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=50),
        module,
        disable_bucketing=True,
    )
    layouts = [len(model.buffers), [len(b.buckets) for b in model.buffers], len(model.bucket_groups)]
    grouped = partition_buckets(model.buffers, force_single_bucket_group=False)
    layouts.append(len(grouped))
    return layouts


def test_disable_bucketing_puts_every_bucket_in_one_group():
    for buffers, buckets, groups, default_groups in run_distributed(2, _single_bucket_group):
        assert buffers == 2 and buckets == [1, 1]
        assert groups == 1 and default_groups == 2  # default: one group per bucket


def test_group_params_for_buffers():
    a, b, c = (
        torch.nn.Parameter(torch.zeros(2)),
        torch.nn.Parameter(torch.zeros(2).half()),
        torch.nn.Parameter(torch.zeros(3)),
    )
    assert group_params_for_buffers([a, b, c], grad_reduce_in_fp32=False) == {
        BufferKey(torch.float32, torch.float32): ([a, c], [0, 2]),
        BufferKey(torch.float16, torch.float16): ([b], [1]),
    }
    in_fp32 = group_params_for_buffers([a, b, c], grad_reduce_in_fp32=True)
    assert list(in_fp32) == [BufferKey(torch.float32, torch.float32), BufferKey(torch.float16, torch.float32)]
    assert [m for m in BufferType] == [BufferType.PARAM, BufferType.GRAD]


def test_partition_buckets_refuses_fp32_accumulation():
    with pytest.raises(ValueError, match=r"not supported yet: reduce-scatter with fp32 accumulation"):
        partition_buckets([], reduce_scatter_with_fp32_accumulation=True)


def _layout_missing_a_buffer():
    Utils.initialize_model_parallel()
    try:
        DistributedDataParallel(
            model_config(), DistributedDataParallelConfig(), TinyLM(), full_param_layout=FullParamLayout()
        )
    except ValueError as error:
        return str(error)


def test_a_full_param_layout_missing_a_buffer_is_refused_before_any_collective():
    (message,) = run_distributed(1, _layout_missing_a_buffer)
    assert "full_param_layout has no layout for the buffer BufferKey(param_dtype=" in message
    assert "DistributedOptimizer.compute_full_param_layout" in message


def _moe_param_order():
    Utils.initialize_model_parallel()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    options = dict(normalization="RMSNorm", qk_layernorm=True)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        use_cpu_initialization=True,
        num_moe_experts=2,
        moe_router_topk=2,
        add_bias_linear=False,
        gated_linear_unit=True,
        **options,
    )
    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=2, **options), 16, 8)
    return [name for name, _ in model.named_parameters()]


def test_moe_parameters_register_in_megatrons_order():
    """Registration order is DDP's buffer order, which the distributed optimizer's bucket-space checkpoints depend
    on. The golden list is Megatron-Core 0.19's own GPTModel with the same config (one-off, by printing
    named_parameters() of Megatron's model built like this one)."""
    golden = json.loads((Path(__file__).parent / "megatron_0_19_moe_param_order.json").read_text())
    assert run_distributed(1, _moe_param_order)[0] == golden
