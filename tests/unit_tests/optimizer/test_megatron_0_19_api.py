"""Megatron-Core 0.19's optimizer API: per-parameter overrides (ParamKey), skipping steps on a gradient-norm spike,
grad-norm groups, offloading the state, and the options of features not built here."""

import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import (
    AdamOptimizerConfig,
    ChainedOptimizer,
    OptimizerConfig,
    ParamKey,
    ParamPredicate,
    ParamWithNamePredicate,
    SGDOptimizerConfig,
    check_config_overrides_consistency,
    get_megatron_optimizer,
    get_mup_config_overrides,
    get_standard_config_overrides,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range
from megatron.core.optimizer.optimizer import ProxyDict
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging
from megatron.core.transformer.module import Float16Module
from tests.unit_tests.distributed.ddp_test_helpers import TinyLM, model_config, train_data_parallel, weights, wrap
from tests.unit_tests.test_utilities import Utils, run_distributed

# ---- ParamKey ------------------------------------------------------------------------------------------------------


def test_param_key_matches_any_of_its_criteria():
    weight, bias = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    weight.is_embedding_or_output_parameter = True
    assert ParamKey(name="*.bias").matches(bias, "layers.0.bias")
    assert not ParamKey(name="*.bias").matches(weight, "layers.0.weight")
    assert ParamKey(name=("x", "layers.?.weight")).matches(weight, "layers.0.weight")
    assert ParamKey(attr="is_embedding_or_output_parameter").matches(weight, "w")
    assert not ParamKey(attr="is_embedding_or_output_parameter").matches(bias, "b")
    one_d = ParamPredicate(name="1d", fn=lambda p: p.dim() == 1)
    assert ParamKey(predicate=one_d).matches(bias, "b") and not ParamKey(predicate=one_d).matches(weight, "w")
    named = ParamWithNamePredicate(name="fc1", fn=lambda p, name: "fc1" in name and p.dim() == 2)
    assert ParamKey(with_name_predicate=(named,)).matches(weight, "mlp.fc1.weight")
    assert not ParamKey().matches(weight, "anything")
    # Predicates are compared by name only, so equal keys can be rebuilt (e.g. in another process).
    assert ParamKey(predicate=one_d) == ParamKey(predicate=ParamPredicate(name="1d", fn=lambda p: False))
    assert len({ParamKey(name="*.bias"), ParamKey(name="*.bias")}) == 1


# ---- config_overrides in get_megatron_optimizer --------------------------------------------------------------------


def _groups_by_name(optimizer, model):
    names = {param: name for name, param in model.named_parameters()}
    return {names[param]: group for group in optimizer.param_groups for param in group["params"]}


def _overrides_drive_groups_and_schedule():
    Utils.initialize_model_parallel()
    model = TinyLM()
    config = OptimizerConfig(lr=1.0, min_lr=0.0, weight_decay=0.1)
    overrides = get_standard_config_overrides(config)
    overrides[ParamKey(name="layers.1.*")] = {"max_lr": 0.25, "min_lr": 0.125}
    overrides[ParamKey(name="layers.2.weight")] = {"eps": 1e-3, "wd_mult": 0.5}
    optimizer = get_megatron_optimizer(config, [model], config_overrides=overrides)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=10,
        lr_decay_style="linear",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=10,
        wd_incr_style="constant",
    )
    scheduler.step(5)
    by_name = _groups_by_name(optimizer, model)
    summary = {
        name: (group["lr"], group["weight_decay"], group["eps"], group["default_config"])
        for name, group in by_name.items()
        if name in ("layers.0.weight", "layers.1.weight", "layers.1.bias", "layers.2.weight", "norm.weight")
    }
    with pytest.raises(ValueError, match="conflicting parameter-group overrides: max_lr=0.5 and max_lr=0.25"):
        get_megatron_optimizer(
            config,
            [model],
            config_overrides={
                ParamKey(name="layers.1.*"): {"max_lr": 0.5},
                ParamKey(name="*.bias"): {"max_lr": 0.25},
            },
        )
    with pytest.raises(ValueError, match="sets optimizer='sgd' but the optimizer has optimizer='adam'"):
        get_megatron_optimizer(config, [model], config_overrides={ParamKey(name="*"): {"optimizer": "sgd"}})
    with pytest.raises(ValueError, match="sets 'params', which is protected"):
        check_config_overrides_consistency(config, {ParamKey(name="*"): {"params": []}})
    no_overrides = get_megatron_optimizer(config, [model], config_overrides={})
    return summary, get_canonical_lr_for_logging(optimizer.param_groups), len(no_overrides.param_groups)


def test_config_overrides_select_groups_that_the_scheduler_and_torch_follow():
    summary, canonical_lr, groups_without_overrides = run_distributed(1, _overrides_drive_groups_and_schedule)[0]
    # Halfway through a linear decay from 1.0: the default groups are at 0.5; layers.1 decays 0.25 -> 0.125.
    assert summary["layers.0.weight"] == pytest.approx((0.5, 0.1, 1e-8, True))
    assert summary["layers.1.weight"] == pytest.approx((0.1875, 0.1, 1e-8, False))
    assert summary["layers.1.bias"] == pytest.approx((0.1875, 0.0, 1e-8, False))  # both overrides combined
    assert summary["layers.2.weight"] == pytest.approx((0.5, 0.05, 1e-3, True))  # torch's own eps per group
    assert summary["norm.weight"] == pytest.approx((0.5, 0.0, 1e-8, True))
    assert canonical_lr == pytest.approx(0.5)
    assert groups_without_overrides == 1  # {}: no overrides at all, every parameter decays


def _qk_layernorm_and_mup_overrides():
    Utils.initialize_model_parallel()
    q_norm, bias, matrix, embedding = (torch.nn.Parameter(torch.zeros(shape)) for shape in ((4,), (4,), (4, 4), (8, 4)))
    named = {
        "attn.q_layernorm.weight": q_norm,
        "attn.linear_qkv.bias": bias,
        "attn.linear_qkv.weight": matrix,
        "embedding.word_embeddings.weight": embedding,
    }

    def decays(config):
        keys = get_standard_config_overrides(config)
        return {
            name: not any(key.matches(p, name) and o.get("wd_mult") == 0.0 for key, o in keys.items())
            for name, p in named.items()
        }

    mup = get_mup_config_overrides(OptimizerConfig(lr=1.0, min_lr=0.1, adam_eps=1e-8), mup_width_mult=4.0)
    mup_of = {name: [o for key, o in mup.items() if key.matches(p, name)] for name, p in named.items()}
    sgd_mup = get_mup_config_overrides(OptimizerConfig(lr=1.0), mup_width_mult=4.0, optimizer_type="sgd")
    sgd_of = {name: [o for key, o in sgd_mup.items() if key.matches(p, name)] for name, p in named.items()}
    return (
        decays(OptimizerConfig()),
        decays(OptimizerConfig(apply_wd_to_qk_layernorm=True)),
        mup_of,
        sgd_of,
        get_mup_config_overrides(OptimizerConfig(lr=1.0), 1.0),
    )


def test_qk_layernorm_weight_decay_and_mup_overrides():
    default, with_qk, mup, sgd, unit_width = run_distributed(1, _qk_layernorm_and_mup_overrides)[0]
    assert default == {
        "attn.q_layernorm.weight": False,
        "attn.linear_qkv.bias": False,
        "attn.linear_qkv.weight": True,
        "embedding.word_embeddings.weight": True,
    }
    assert with_qk["attn.q_layernorm.weight"] and not with_qk["attn.linear_qkv.bias"]
    # Adam: hidden matrices get lr / width and eps / width; embeddings and vectors keep theirs.
    assert mup["attn.linear_qkv.weight"] == [{"max_lr": 0.25, "min_lr": 0.025, "eps": 2.5e-9}]
    assert mup["embedding.word_embeddings.weight"] == [] and mup["attn.linear_qkv.bias"] == []
    # SGD: vector-like parameters get lr x width.
    assert sgd["attn.linear_qkv.bias"] == [{"max_lr": 4.0}] and sgd["attn.linear_qkv.weight"] == []
    assert unit_width == {}


def _config_classes_build_their_optimizer():
    Utils.initialize_model_parallel()
    model = TinyLM()
    adam = get_megatron_optimizer(AdamOptimizerConfig(lr=1.0), [model])
    sgd = get_megatron_optimizer(SGDOptimizerConfig(lr=1.0, sgd_momentum=0.5), [model])
    return type(adam.optimizer).__name__, type(sgd.optimizer).__name__, sgd.param_groups[0]["momentum"]


def test_adam_and_sgd_config_classes():
    assert run_distributed(1, _config_classes_build_their_optimizer)[0] == ("AdamW", "SGD", 0.5)
    with pytest.raises(ValueError, match="AdamOptimizerConfig.optimizer must be 'adam'"):
        AdamOptimizerConfig(optimizer="sgd")


def test_optimizer_config_takes_megatrons_dtype_names_and_inert_knobs():
    config = OptimizerConfig(
        main_grads_dtype="fp32",
        exp_avg_dtype="fp32",
        fp8_recipe="delayed",
        muon_momentum=0.9,
        optimizer_offload_fraction=1.0,
    )
    assert config.main_grads_dtype is torch.float32 and config.exp_avg_dtype is torch.float32


# ---- grad_norm_skip_threshold --------------------------------------------------------------------------------------


def _steps(optimizer):
    return sorted({float(state["step"]) for state in optimizer.state.values() if "step" in state})


def _spike_is_skipped():
    Utils.initialize_model_parallel()
    results = {}
    cases = (
        ("fp32", None, False, False),
        ("bf16", "bf16", False, False),
        ("bf16-distopt", "bf16", True, False),
        ("chained", None, False, True),
    )
    for name, precision, distributed, chained in cases:
        config = model_config(**({precision: True} if precision else {}))
        module = TinyLM()
        if chained:
            for param in module.layers[0].parameters():
                param.allreduce = False
        module = module if precision is None else Float16Module(config, module)
        model = wrap(module, DistributedDataParallelConfig(use_distributed_optimizer=distributed), config)
        opt_config = OptimizerConfig(
            lr=1e-2, bf16=precision == "bf16", use_distributed_optimizer=distributed, grad_norm_skip_threshold=1e3
        )
        optimizer = get_megatron_optimizer(opt_config, [model])
        assert isinstance(optimizer, ChainedOptimizer) == chained
        train_data_parallel(model, optimizer, 1, 4, 1)
        before, steps_before = weights(model), _steps(optimizer)
        spike = train_data_parallel(model, optimizer, 1, 4, 1, inject=lambda step, loss: loss * 1e6)[0]
        unchanged = all(torch.equal(a, b) for a, b in zip(before.values(), weights(model).values()))
        steps_after_spike = _steps(optimizer)
        normal = train_data_parallel(model, optimizer, 1, 4, 1)[0]
        moved = any(not torch.equal(a, b) for a, b in zip(before.values(), weights(model).values()))
        results[name] = (
            spike > 1e3,
            unchanged,
            steps_before == steps_after_spike == [1.0],
            normal < 1e3,
            moved,
            _steps(optimizer),
        )
    return results


def test_grad_norm_above_the_threshold_skips_the_step():
    for name, (spiked, unchanged, adam_untouched, normal, moved, steps) in run_distributed(2, _spike_is_skipped)[
        0
    ].items():
        assert spiked and unchanged and adam_untouched, name  # weights and Adam's moments/step left alone
        assert normal and moved and steps == [2.0], name  # the next ordinary step trains


def _skip_reports_the_norm():
    Utils.initialize_model_parallel()
    model = wrap(TinyLM(), DistributedDataParallelConfig())
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, grad_norm_skip_threshold=1.0, log_num_zeros_in_grad=True), [model]
    )
    model.zero_grad_buffer()
    model.module.layers[1].weight.main_grad.fill_(1.0)
    return optimizer.step()


def test_skipped_step_returns_the_norm_and_zero_count():
    success, grad_norm, zeros = run_distributed(1, _skip_reports_the_norm)[0]
    assert success is False and grad_norm == pytest.approx(16.0) and zeros is not None


# ---- grad-norm groups, offload, state helpers ----------------------------------------------------------------------


def _grad_norm_groups_and_offload():
    Utils.initialize_model_parallel()
    model = wrap(TinyLM(), DistributedDataParallelConfig())
    model.module.layers[3].weight.grad_norm_group = "head"
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [model])
    model.zero_grad_buffer()
    for param in model.module.parameters():
        param.main_grad.fill_(1.0)
    optimizer.prepare_grads()
    main = optimizer.get_grads_for_grad_norm()
    head = optimizer.get_grads_for_grad_norm("head")
    has = (optimizer.has_grad_norm_group("head"), optimizer.has_grad_norm_group("other"))
    del model.module.layers[3].weight.grad_norm_group  # the twin below has no separate group

    twin_model = wrap(TinyLM(), DistributedDataParallelConfig())
    twin = get_megatron_optimizer(OptimizerConfig(lr=1e-2), [twin_model])
    train_data_parallel(model, optimizer, 1, 4, 1)
    train_data_parallel(twin_model, twin, 1, 4, 1)
    optimizer.offload_to_cpu()
    offloaded = {state["exp_avg"].device.type for state in optimizer.state.values()}
    optimizer.restore_from_cpu()
    train_data_parallel(model, optimizer, 1, 4, 1)
    train_data_parallel(twin_model, twin, 1, 4, 1)
    same = all(torch.equal(a, b) for a, b in zip(weights(model).values(), weights(twin_model).values()))
    return len(main), [tuple(g.shape) for g in head], has, offloaded, same


def test_grad_norm_groups_and_offload_round_trip():
    main, head, has, offloaded, same = run_distributed(2, _grad_norm_groups_and_offload)[0]
    assert main == 11 and head == [(16, 16)]  # the tagged weight is left out of the main norm
    assert has == (True, False)
    assert offloaded == {"cpu"} and same


def _state_helpers():
    Utils.initialize_model_parallel()
    config = model_config(bf16=True)
    model = wrap(Float16Module(config, TinyLM()), DistributedDataParallelConfig(), config)
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, bf16=True), [model])
    loading = optimizer.state_dict(is_loading=True)
    distopt_model = wrap(TinyLM(), DistributedDataParallelConfig(use_distributed_optimizer=True))
    distopt = get_megatron_optimizer(OptimizerConfig(lr=1e-2, use_distributed_optimizer=True), [distopt_model])
    with pytest.raises(ValueError, match=r"not supported yet: several distributed-optimizer instances"):
        DistributedOptimizer(
            distopt.optimizer,
            distopt.config,
            None,
            None,
            [distopt_model],
            {0: distopt_model.buffers},
            distopt.data_parallel_group,
            None,
            0,
            1,
        )
    return len(loading["optimizer"]["state"]), distopt.optimizer_state_keys


def test_state_dict_for_loading_and_optimizer_state_keys():
    states, keys = run_distributed(1, _state_helpers)[0]
    assert states == 12 and keys == ("exp_avg", "exp_avg_sq")


def test_proxy_dict_and_range():
    first, second = {"a": 1}, {"b": 2}
    proxy = ProxyDict([first, second])
    proxy["b"] = 3
    assert proxy["a"] == 1 and second == {"b": 3} and "b" in proxy and len(proxy) == 2
    assert dict(proxy.items()) == {"a": 1, "b": 3} and list(proxy) == ["a", "b"]
    with pytest.raises(KeyError):
        proxy["c"]
    span = Range(10, 14).normalize(2)
    assert (span.start, span.end, span.size) == (2, 6, 4)


# ---- dump_param_to_param_group_map ---------------------------------------------------------------------------------


def _dump_map_at_pp2(directory):
    from megatron.core.optimizer import OptimizerConfig as Config
    from tests.unit_tests.dist_checkpointing.gpt_checkpoint_helpers import build_chunks

    chunks, _ = build_chunks(tp=1, pp=2)
    get_megatron_optimizer(Config(lr=1e-2), chunks, dump_param_to_param_group_map=directory)
    torch.distributed.barrier()
    reader = torch.distributed.checkpoint.FileSystemReader(directory)
    mapping = {name: None for name in reader.read_metadata().state_dict_metadata}
    torch.distributed.checkpoint.load(mapping, storage_reader=reader)
    return mapping


def test_param_to_param_group_map_names_layers_globally(tmp_path):
    mapping = run_distributed(2, _dump_map_at_pp2, str(tmp_path / "map"))[0]
    layers = {name.split("decoder.layers.")[1].split(".")[0] for name in mapping if "decoder.layers." in name}
    assert layers == {"0", "1", "2", "3"}  # stage 1's local layers 0 and 1 are global layers 2 and 3
    fc1 = "module.decoder.layers.{}.mlp.linear_fc1.{}"
    assert mapping[fc1.format(3, "weight")] != mapping[fc1.format(3, "bias")]  # decayed / not decayed
    assert mapping[fc1.format(0, "weight")] == mapping[fc1.format(3, "weight")]  # the same group on both stages
