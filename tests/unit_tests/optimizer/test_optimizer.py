"""get_megatron_optimizer's parameter groups and choices, state-dict round trips, clipping and bad input."""

import copy

import pytest
import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing import CheckpointingException
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import (
    ChainedOptimizer,
    OptimizerConfig,
    ParamKey,
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.transformer.module import Float16Module
from tests.unit_tests.distributed.ddp_test_helpers import TinyLM, model_config, train_data_parallel, weights, wrap
from tests.unit_tests.test_utilities import Utils, run_distributed


def _param_groups():
    Utils.initialize_model_parallel()
    model = TinyLM()
    config = OptimizerConfig(lr=1.0, min_lr=0.1, decoupled_lr=0.5, decoupled_min_lr=0.05, weight_decay=0.2)
    overrides = get_standard_config_overrides(config)
    overrides[ParamKey(name="layers.3.*")] = {"lr_mult": 3.0}
    optimizer = get_megatron_optimizer(config, [model], config_overrides=overrides)
    names = {p: n for n, p in model.named_parameters()}
    groups = [
        (
            sorted(names[p] for p in g["params"]),
            {k: g[k] for k in ("wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr", "lr", "weight_decay")},
        )
        for g in optimizer.param_groups
    ]
    custom = get_megatron_optimizer(
        OptimizerConfig(lr=1.0, optimizer="sgd", decoupled_weight_decay=False),
        [model],
        config_overrides={ParamKey(name="output"): {"wd_mult": 0.0}},
    )
    adam_l2 = get_megatron_optimizer(OptimizerConfig(lr=1.0, decoupled_weight_decay=False), [model])
    return (
        groups,
        [sorted(names[p] for p in g["params"]) for g in custom.param_groups],
        [
            type(custom.optimizer).__name__,
            type(adam_l2.optimizer).__name__,
            type(get_megatron_optimizer(OptimizerConfig(lr=1.0), [model]).optimizer).__name__,
        ],
    )


def test_param_groups_weight_decay_decoupled_lr_and_lr_mult():
    groups, custom, torch_classes = run_distributed(1, _param_groups)[0]
    by_first = {names[0]: settings for names, settings in groups}
    all_names = sorted(n for names, _ in groups for n in names)
    assert len(all_names) == 12
    # Matrices decay; biases and norms (1-D) do not; embedding/output get the decoupled lr; layers.3 gets lr_mult.
    assert by_first["layers.0.weight"] == dict(
        wd_mult=1.0, lr_mult=1.0, is_decoupled_lr=False, max_lr=1.0, min_lr=0.1, lr=1.0, weight_decay=0.2
    )
    assert by_first["layers.0.bias"]["wd_mult"] == 0.0 and by_first["layers.0.bias"]["weight_decay"] == 0.0
    assert [names for names, _ in groups if "norm.weight" in names][0].count("norm.bias") == 1
    assert by_first["embedding.weight"] == dict(
        wd_mult=1.0, lr_mult=1.0, is_decoupled_lr=True, max_lr=0.5, min_lr=0.05, lr=0.5, weight_decay=0.2
    )
    assert [names for names, _ in groups if "embedding.weight" in names][0] == ["embedding.weight", "output"]
    assert by_first["layers.3.weight"]["lr_mult"] == 3.0 and by_first["layers.3.weight"]["lr"] == 3.0
    # Custom overrides replace the standard ones entirely.
    assert ["output"] in custom and any("layers.0.bias" in names for names in custom if len(names) > 1)
    assert torch_classes == ["SGD", "Adam", "AdamW"]


def _state_round_trip():
    """Train 3 steps straight, or 2 steps + save + fresh model/optimizer + load + 1 step: identical weights."""
    Utils.initialize_model_parallel()
    results = {}
    cases = (("fp32", None, False), ("bf16", "bf16", False), ("bf16-distopt", "bf16", True))
    for name, precision, distributed in cases:

        def build():
            config = model_config(**({precision: True} if precision else {}))
            module = TinyLM() if precision is None else Float16Module(config, TinyLM())
            model = wrap(
                module,
                DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed),
                config,
            )
            opt_config = OptimizerConfig(lr=1e-2, bf16=precision == "bf16", use_distributed_optimizer=distributed)
            return model, get_megatron_optimizer(opt_config, [model])

        model, optimizer = build()
        train_data_parallel(model, optimizer, 2, 4, 1)
        saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
        # The distributed optimizer's state_dict() is only the data-parallel-independent part, as in Megatron: its
        # parameter state (fp32 main shards, Adam's moments) is gathered on data-parallel rank 0 (None elsewhere).
        saved_parameters = optimizer.get_parameter_state_dp_zero() if distributed else None
        train_data_parallel(model, optimizer, 1, 4, 1)
        model_b, optimizer_b = build()
        model_b.load_state_dict(saved_model)
        optimizer_b.load_state_dict(saved_optimizer)
        if distributed:
            optimizer_b.load_parameter_state_from_dp_zero(saved_parameters)
        train_data_parallel(model_b, optimizer_b, 1, 4, 1)
        pairs = zip(weights(model).values(), weights(model_b).values())
        results[name] = max((a - b).abs().max().item() for a, b in pairs)
        if distributed:
            assert set(saved_optimizer) == {"optimizer"} and set(saved_optimizer["optimizer"]) == {"param_groups"}
            assert {group["step"] for group in saved_optimizer["optimizer"]["param_groups"]} == {2}
            broken = copy.deepcopy(saved_parameters)
            if broken is not None:  # data-parallel rank 0 holds the world tensors; the other ranks learn its error
                broken[0][next(iter(broken[0]))]["numel_unpadded"] -= 1
            mismatch = (
                r"rank\(s\) 0: DistributedOptimizer: buffer 0 holds (\d+) unpadded elements in this run but (?!\1)\d+ "
            )
            with pytest.raises(CheckpointingException, match=mismatch + "in the checkpoint's parameter state"):
                optimizer_b.load_parameter_state_from_dp_zero(broken)
        elif precision:
            with pytest.raises(KeyError, match=r"lacks \['fp32_from_fp16_params'\]"):
                optimizer_b.load_state_dict({"optimizer": saved_optimizer["optimizer"]})
    return results


def test_state_dict_round_trip_resumes_exactly():
    for results in run_distributed(2, _state_round_trip):
        assert results == {"fp32": 0.0, "bf16": 0.0, "bf16-distopt": 0.0}


def _parameter_state_files(root):
    """save_parameter_state / load_parameter_state (Megatron's legacy distrib_optim.pt) of one distributed optimizer
    and of a chain of two (dense and expert parameters): with state_dict(), a fresh job resumes exactly."""
    Utils.initialize_model_parallel()
    results, errors = {}, []
    for name, with_experts in (("single", False), ("chained", True)):

        def build(seed):
            module = TinyLM(seed=seed)
            for param in module.layers[0].parameters() if with_experts else []:
                param.allreduce = False  # expert parameters: a second DistributedOptimizer over the expert DP group
            model = wrap(module, DistributedDataParallelConfig(use_distributed_optimizer=True))
            return model, get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [model])

        path = f"{root}/{name}.pt"
        model, optimizer = build(seed=1)
        train_data_parallel(model, optimizer, 2, 4, 1)
        saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
        optimizer.save_parameter_state(path)
        train_data_parallel(model, optimizer, 1, 4, 1)
        model_b, optimizer_b = build(seed=2)
        model_b.load_state_dict(saved_model)
        optimizer_b.load_state_dict(saved_optimizer)
        optimizer_b.load_parameter_state(path)
        train_data_parallel(model_b, optimizer_b, 1, 4, 1)
        pairs = zip(weights(model).values(), weights(model_b).values())
        results[name] = (type(optimizer).__name__, max((a - b).abs().max().item() for a, b in pairs))
        if dist.get_rank() == 0:
            stored = torch.load(path, weights_only=True)
            results[name] += (len(stored) if isinstance(stored, list) else type(stored).__name__,)
            if with_experts:
                torch.save(stored[:1], f"{root}/one_of_two.pt")
        dist.barrier()
        for bad_file in ([f"{root}/one_of_two.pt"] if with_experts else []) + [f"{root}/missing.pt"]:
            with pytest.raises(CheckpointingException) as info:
                optimizer_b.load_parameter_state(bad_file)
            errors.append(str(info.value))
    return results, errors


def test_parameter_state_files_resume_exactly_for_one_and_chained_optimizers(tmp_path):
    for rank, (results, errors) in enumerate(run_distributed(2, _parameter_state_files, str(tmp_path))):
        # One file per checkpoint: a single optimizer's world tensors, or a list of them per chained optimizer.
        expected = {"single": ("DistributedOptimizer", 0.0, "dict"), "chained": ("ChainedOptimizer", 0.0, 2)}
        assert results == ({k: v[:2] for k, v in expected.items()} if rank else expected)
        # Data-parallel rank 0 reads the file; every rank stops with its error instead of waiting for its broadcast.
        assert "parameter state failed on rank(s) 0: the distributed optimizer's parameter state " in errors[0]
        assert f"{tmp_path}/missing.pt does not exist: check the path" in errors[0]
        assert f"{tmp_path}/one_of_two.pt holds a list of 1 parameter states, but this run chains 2 " in errors[1]
        assert "the chained optimizers' parameter state " in errors[2] and "missing.pt" in errors[2]


def _chained_and_counted():
    Utils.initialize_model_parallel()
    module = TinyLM()
    for param in module.layers[0].parameters():
        param.allreduce = False
    model = wrap(module, DistributedDataParallelConfig())
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, log_num_zeros_in_grad=True, clip_grad=0.0), [model])
    assert isinstance(optimizer, ChainedOptimizer)
    model.zero_grad_buffer()
    module.layers[1].weight.main_grad.fill_(1.0)  # 256 non-zeros; everything else zero
    success, grad_norm, zeros = optimizer.step()
    total = sum(p.numel() for p in module.parameters())
    with pytest.raises(ValueError, match="holds 1 optimizer states, this optimizer chains 2"):
        optimizer.load_state_dict(optimizer.state_dict()[:1])
    return success, grad_norm, zeros, total, len(optimizer.param_groups)


def test_chained_optimizer_combines_norms_and_zero_counts():
    success, grad_norm, zeros, total, groups = run_distributed(1, _chained_and_counted)[0]
    assert success and grad_norm == pytest.approx(16.0) and zeros == total - 256
    assert groups == 4  # dense and expert, each with and without weight decay


def _clip_and_count_under_tensor_parallel():
    Utils.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    split = torch.nn.Parameter(torch.zeros(3))
    split.tensor_model_parallel = True
    split.grad = torch.tensor([3.0, 0.0, 4.0]) * (rank + 1)
    replicated = torch.nn.Parameter(torch.zeros(2))
    replicated.grad = torch.tensor([0.0, 12.0])
    shared = torch.nn.Parameter(torch.zeros(1))
    shared.shared = True
    shared.grad = torch.tensor([100.0])
    from megatron.core.optimizer.clip_grads import counts_for_grad_stats

    counted = [p.grad for p in (split, replicated, shared) if counts_for_grad_stats(p)]
    norm = get_grad_norm_fp32(counted)
    inf_norm = get_grad_norm_fp32(counted, norm_type=float("inf"))
    zeros = count_zeros_fp32([split, replicated, shared], None)
    clip_grad_by_total_norm_fp32([split, replicated], max_norm=norm / 2, total_norm=norm)
    with pytest.raises(ValueError, match="norm_type must be positive"):
        get_grad_norm_fp32(counted, norm_type=0)
    return norm, inf_norm, zeros, split.grad.tolist()


def test_grad_norm_counts_replicated_and_shared_parameters_once():
    results = run_distributed(2, _clip_and_count_under_tensor_parallel)
    # split grads (5 and 10 in norm) on both ranks, the replicated one (12) once, the shared copy not at all.
    expected = (25 + 100 + 144) ** 0.5
    for rank, (norm, inf_norm, zeros, clipped) in enumerate(results):
        assert norm == pytest.approx(expected) and inf_norm == 12.0 and zeros == 3
        assert clipped == pytest.approx([1.5 * (rank + 1), 0.0, 2.0 * (rank + 1)], rel=1e-5)


def _bad_requests():
    Utils.initialize_model_parallel()
    model = TinyLM()
    errors = []
    for config, chunks in (
        (OptimizerConfig(), [model]),
        (OptimizerConfig(lr=1.0, use_distributed_optimizer=True), [model]),
        (OptimizerConfig(lr=1.0), [wrap(TinyLM(), DistributedDataParallelConfig(use_distributed_optimizer=True))]),
        (OptimizerConfig(lr=1.0, loss_scale=128.0), [model]),
        (OptimizerConfig(lr=1.0), [torch.nn.Linear(2, 2).requires_grad_(False)]),
    ):
        with pytest.raises(ValueError) as info:
            get_megatron_optimizer(config, chunks)
        errors.append(str(info.value))
    return errors


def test_get_megatron_optimizer_rejects_bad_requests():
    errors = run_distributed(1, _bad_requests)[0]
    assert "OptimizerConfig.lr is None" in errors[0]
    assert "model chunk 0 is not wrapped in DistributedDataParallel" in errors[1]
    assert "use_distributed_optimizer=False but model chunk 0 was wrapped with" in errors[2]
    assert "loss_scale=128.0 needs fp16 or bf16" in errors[3]
    assert "no trainable parameters" in errors[4]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(optimizer="adagrad"),
            r"optimizer='adagrad' is not supported; use one of \('adam', 'sgd', 'lion', 'muon', 'dist_muon'\)",
        ),
        (dict(optimizer="soap"), r"not supported yet: the soap optimizer \(optimizer='soap'\)"),
        (dict(fp16=True, bf16=True), "fp16 and bf16 are both set"),
        (
            dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.5),
            r"optimizer_offload_fraction=1.5 is outside \[0, 1\]",
        ),
        (dict(use_precision_aware_optimizer=True), r"precision_aware_optimizer=True needs use_distributed_optimizer"),
        (dict(exp_avg_dtype=torch.bfloat16), r"exp_avg_dtype=torch.bfloat16 needs use_precision_aware_optimizer=True"),
        (dict(main_params_dtype="fp16"), r"main_params_dtype=torch.float16 needs use_precision_aware_optimizer=True"),
        (
            dict(use_layer_wise_distributed_optimizer=True),
            r"use_layer_wise_distributed_optimizer=True needs optimizer='muon' or 'dist_muon', got optimizer='adam'",
        ),
        (
            dict(overlap_param_gather_with_optimizer_step=True),
            r"not supported yet: overlapping .* \(overlap_param_gather_with_optimizer_step=True\)",
        ),
        (dict(reuse_grad_buf_for_mxfp8_param_ag=True), r"not supported yet: mxfp8 .* \(reuse_grad_buf_for_mxfp8"),
        (dict(optimizer_cuda_graph=True), r"not supported yet: CUDA graph .* \(optimizer_cuda_graph=True\)"),
        (dict(grad_norm_skip_threshold=0.0), "grad_norm_skip_threshold must be positive"),
        (dict(lr=1e-4, min_lr=1e-3), "min_lr=0.001 is larger than lr=0.0001"),
        (dict(clip_grad=-1.0), "clip_grad must be >= 0"),
        (dict(loss_scale=0.0), "loss_scale must be positive or None, got 0.0"),
        (dict(hysteresis=0), "hysteresis must be >= 1, got 0"),
    ],
)
def test_optimizer_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


def _init_state_and_reload():
    Utils.initialize_model_parallel()
    results = {}
    for distributed in (False, True):
        config = model_config(bf16=True)

        def build():
            model = wrap(
                Float16Module(config, TinyLM()),
                DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                config,
            )
            opt_config = OptimizerConfig(lr=1e-2, bf16=True, use_distributed_optimizer=distributed)
            return model, get_megatron_optimizer(opt_config, [model]), opt_config

        # Zero state created up front (as before loading a checkpoint) steps exactly like lazily created state.
        eager, eager_opt, opt_config = build()
        eager_opt.init_state_fn(eager_opt.optimizer, opt_config)
        bytes_before_step = eager_opt.state_bytes()
        lazy, lazy_opt, _ = build()
        train_data_parallel(eager, eager_opt, 2, 4, 1)
        train_data_parallel(lazy, lazy_opt, 2, 4, 1)
        same = all(torch.equal(a, b) for a, b in zip(weights(eager).values(), weights(lazy).values()))

        # reload_model_params: after new weights are loaded into the model, the fp32 main copies follow them.
        fresh_weights = TinyLM(seed=7).state_dict()
        lazy.load_state_dict(fresh_weights)
        lazy_opt.reload_model_params()
        if distributed:
            pairs = [
                (e.main_param, e.model_param.view(-1)[e.shard.param_start : e.shard.param_end])
                for e in lazy_opt._entries()
            ]
        else:
            pairs = [
                (main, model_param.view(-1))
                for mains, params in zip(lazy_opt.fp32_from_float16_groups, lazy_opt.float16_groups)
                for main, model_param in zip(mains, params)
            ]
        main_follow = max((main.view(-1) - param.detach().float()).abs().max().item() for main, param in pairs)
        results[distributed] = (same, bytes_before_step == lazy_opt.state_bytes(), main_follow)
    return results


def test_init_state_fn_and_reload_model_params():
    for same, same_bytes, main_follow in run_distributed(1, _init_state_and_reload)[0].values():
        assert same and same_bytes
        assert main_follow == 0.0
