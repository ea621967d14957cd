"""DDP details: bucket layout, NaN detection, parameter broadcast, unused parameters, per-token loss, bad configs."""

import gc
import math
import weakref

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from tests.unit_tests.distributed.ddp_test_helpers import TinyLM, make_batch, model_config, wrap
from tests.unit_tests.test_utilities import Utils, run_distributed


def _layouts_on_one_rank():
    Utils.initialize_model_parallel()
    plain = wrap(TinyLM(tie=True), DistributedDataParallelConfig())
    bucketed = wrap(TinyLM(), DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=300))
    default_overlap = wrap(TinyLM(), DistributedDataParallelConfig(overlap_grad_reduce=True))
    sharded = wrap(TinyLM(tie=True), DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=300))

    def describe(model):
        buffer = model.buffers[0]
        return {
            "buckets": [[model.param_to_name[p] for p in bucket.params_list] for bucket in buffer.buckets],
            "starts": [buffer.param_index_map[p][0] for p in buffer.params],
            "bucket_numels": [bucket.grad_data.numel() for bucket in buffer.buckets],
            "numel": buffer.numel,
            "numel_unpadded": buffer.numel_unpadded,
            "views_into_buffer": all(
                p.main_grad.data_ptr() == buffer.grad_data[buffer.param_index_map[p][0] :].data_ptr()
                for p in buffer.params
            ),
            "params_in_buffer": buffer.param_data is not None
            and all(
                p.data_ptr() == buffer.param_data[buffer.param_index_map[p][0] :].data_ptr() for p in buffer.params
            ),
        }

    return {
        name: describe(m)
        for name, m in [
            ("plain", plain),
            ("bucketed", bucketed),
            ("default_overlap", default_overlap),
            ("sharded", sharded),
        ]
    }


def test_bucket_layout():
    layouts = run_distributed(1, _layouts_on_one_rank)[0]
    plain, bucketed, sharded = layouts["plain"], layouts["bucketed"], layouts["sharded"]
    # Without overlap there is nothing to overlap with: one bucket, no padding, backward (reverse) order.
    assert len(plain["buckets"]) == 1 and plain["numel"] == plain["numel_unpadded"]
    assert plain["buckets"][0][0] == "norm.bias" and plain["buckets"][0][-1] == "embedding.weight"
    assert plain["views_into_buffer"] and not plain["params_in_buffer"]
    assert len(layouts["default_overlap"]["buckets"]) == 1, "the default bucket size (40M elements) holds it all"
    # A bucket closes once it reaches bucket_size elements.
    assert len(bucketed["buckets"]) > 2
    assert all(numel >= 300 for numel in bucketed["bucket_numels"][:-1])
    # Distributed optimizer: params start at multiples of 64, buckets are multiples of lcm(dp, 128), params live
    # in the buffer, and the tied embedding sits in a bucket of its own.
    assert all(start % 64 == 0 for start in sharded["starts"])
    assert all(numel % 128 == 0 for numel in sharded["bucket_numels"])
    assert sharded["params_in_buffer"] and sharded["views_into_buffer"]
    assert ["embedding.weight"] in sharded["buckets"]


def _nan_is_reported(overlap: bool):
    Utils.initialize_model_parallel()
    model = wrap(TinyLM(), DistributedDataParallelConfig(check_for_nan_in_grad=True, overlap_grad_reduce=overlap))
    tokens, labels = make_batch(2)
    for iteration in (1, 2):
        model.zero_grad_buffer()
        loss = model(tokens, labels)
        if iteration == 2:
            loss = loss * math.nan  # every rank: nobody is left waiting in a collective
        try:
            loss.backward()
            model.finish_grad_sync()
        except RuntimeError as error:
            return str(error)
    return "no error"


@pytest.mark.parametrize("overlap", [False, True])
def test_nan_in_gradients_is_reported_with_rank_and_iteration(overlap):
    for rank, message in enumerate(run_distributed(2, _nan_is_reported, overlap)):
        assert f"rank {rank}: found NaN or Inf in local gradients at iteration 2" in message, message
        assert "before the data-parallel reduction" in message and "layers.0.weight" in message


def _broadcast_unused_and_per_token_loss():
    Utils.initialize_model_parallel()
    rank = dist.get_rank()
    # broadcast_params: every rank ends with rank 0's weights.
    model = wrap(TinyLM(seed=100 + rank), DistributedDataParallelConfig())
    model.broadcast_params()
    first_weight = model.module.layers[0].weight.detach().clone()
    gathered = [torch.empty_like(first_weight) for _ in range(2)]
    dist.all_gather(gathered, first_weight)
    rank0_weight = TinyLM(seed=100).layers[0].weight
    broadcast_ok = torch.equal(gathered[0], gathered[1]) and torch.equal(first_weight, rank0_weight)

    # A parameter that gets no gradient (an unused layer) does not stall the overlapped reduction, and
    # start_grad_sync (the pipeline's grad_sync_func) launches only the buckets the hooks did not.
    module = TinyLM()
    module.unused = torch.nn.Linear(2, 2)
    model = wrap(module, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=100))
    tokens, labels = make_batch(2)
    model.zero_grad_buffer()
    model(tokens, labels).backward()
    launched_by_hooks = sum(group.grad_reduce_handles is not None for group in model.bucket_groups)
    model.start_grad_sync()
    model.finish_grad_sync()
    reference = TinyLM()
    reference(tokens, labels).backward()
    unused_ok = (
        module.unused.weight.main_grad.abs().sum().item() == 0.0
        and 0 < launched_by_hooks < len(model.bucket_groups)
        and torch.allclose(module.layers[0].weight.main_grad, reference.layers[0].weight.grad, atol=1e-7)
    )

    # Per-token loss: each rank sums its token losses; finalize_model_grads divides by the global count, which
    # gives the mean over all tokens even though the ranks hold different numbers of tokens.
    config = model_config(calculate_per_token_loss=True)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), TinyLM())
    tokens, labels = make_batch(3)
    mine = slice(0, 1) if rank == 0 else slice(1, 3)
    model.zero_grad_buffer()
    (model(tokens[mine], labels[mine]) * labels[mine].numel()).backward()
    finalize_model_grads([model], num_tokens=torch.tensor(labels[mine].numel()))
    reference = TinyLM()
    reference(tokens, labels).backward()
    per_token_error = max(
        (p.main_grad - r.grad).abs().max().item() for p, r in zip(model.module.parameters(), reference.parameters())
    )
    with pytest.raises(ValueError, match="average_in_collective=True cannot be used with calculate_per_token_loss"):
        DistributedDataParallel(config, DistributedDataParallelConfig(average_in_collective=True), TinyLM())
    return broadcast_ok, unused_ok, per_token_error


def test_broadcast_unused_parameters_and_per_token_loss():
    for broadcast_ok, unused_ok, per_token_error in run_distributed(2, _broadcast_unused_and_per_token_loss):
        assert broadcast_ok and unused_ok
        assert per_token_error < 1e-6


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(bucket_size=0), "bucket_size must be a positive number of elements or None, got 0"),
        (dict(overlap_param_gather=True), "overlap_param_gather=True needs use_distributed_optimizer=True"),
        (dict(fp8_param_gather=True), r"not supported yet: FP8 parameter all-gather \(fp8_param_gather=True\)"),
        (dict(fp4_param_gather=True), r"not supported yet: FP4 parameter all-gather \(fp4_param_gather=True\)"),
        (dict(check_for_large_grads=True), r"not supported yet: .* \(check_for_large_grads=True\)"),
        (dict(num_distributed_optimizer_instances=2), r"not supported yet: .* \(num_distributed_optimizer_instances"),
        (dict(num_buckets=4), r"not supported yet: a fixed number of gradient buckets \(num_buckets=4\)"),
        (dict(nccl_ub=True), r"not supported yet: NCCL user buffers \(nccl_ub=True\)"),
        (dict(reuse_grad_buf_for_mxfp8_param_ag=True), r"not supported yet: mxfp8 .* \(reuse_grad_buf_for_mxfp8"),
        (dict(reduce_scatter_with_fp32_accumulation=True), r"\(reduce_scatter_with_fp32_accumulation=True\)"),
        (dict(param_name_patterns_for_fp32_local_accumulation=("bias",)), r"fp32 local gradient accumulation"),
        (dict(suggested_communication_unit_size=10), r"\(suggested_communication_unit_size=10\)"),
        (dict(keep_fp8_transpose_cache=True), r"\(keep_fp8_transpose_cache=True\)"),
        (dict(fsdp_db_use_persist_buf_on_alloc_fail=True), r"\(fsdp_db_use_persist_buf_on_alloc_fail=True\)"),
        (dict(fsdp_all_gather_in_start_param_sync=False), r"\(fsdp_all_gather_in_start_param_sync=False\)"),
        (dict(outer_dp_sharding_strategy="optim"), r"not supported yet: hybrid FSDP \(outer_dp_sharding_strategy="),
        (dict(fsdp_manual_registration=True), r"\(fsdp_manual_registration=True\)"),
        (dict(delay_wgrad_compute=True), r"not supported yet: delayed weight-gradient compute \(delay_wgrad_comp"),
        (dict(megatron_fsdp_use_decoupled_grad=True), r"\(megatron_fsdp_use_decoupled_grad=True\)"),
        (dict(megatron_fsdp_cuda_graph_mode=True), r"\(megatron_fsdp_cuda_graph_mode=True\)"),
        (dict(megatron_fsdp_enable_fine_grained_param_gather=True), r"fine_grained_param_gather=True\)"),
        (dict(megatron_fsdp_max_pool_double_buffer=True), r"\(megatron_fsdp_max_pool_double_buffer=True\)"),
    ],
)
def test_ddp_config_rejects_unsupported_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedDataParallelConfig(**kwargs)


def test_ddp_config_accepts_megatron_defaults_and_harmless_knobs():
    config = DistributedDataParallelConfig(
        disable_symmetric_registration=True, param_name_patterns_for_fp32_local_accumulation=[]
    )
    assert config.fsdp_all_gather_in_start_param_sync and config.megatron_fsdp_main_params_dtype == torch.float32


def _dropped_wrappers_are_freed():
    Utils.initialize_model_parallel()
    wrappers = []
    for ddp_config in (
        DistributedDataParallelConfig(),
        DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=100),
    ):
        model = wrap(TinyLM(), ddp_config)
        tokens, labels = make_batch(2)
        model(tokens, labels).backward()
        model.finish_grad_sync()
        wrappers.append(weakref.ref(model))
        del model
    gc.collect()
    return [wrapper() is None for wrapper in wrappers]


def test_a_dropped_wrapper_is_freed_with_its_buffers():
    # A wrapper kept alive by its own gradient hooks would keep its buffers and process groups (with their threads)
    # for the life of the process.
    assert run_distributed(1, _dropped_wrappers_are_freed)[0] == [True, True]
