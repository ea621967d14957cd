"""megatron.core.utils: model wrappers, viewless tensors, the memory buffer, version helpers, decorators, profiling
ranges, multi-tensor stand-ins, the CP batch split, checkpoint helpers, straggler detection and parameter hashes."""

import asyncio
import logging
import warnings

import pytest
import torch
import torch.distributed as dist

from megatron.core import config as core_config
from megatron.core import parallel_state as ps
from megatron.core import utils
from tests.unit_tests.test_utilities import run_distributed


# ---- wrappers --------------------------------------------------------------------------------------------------


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.config = "inner-config"
        self.model_type = "encoder_or_decoder"
        self.linear = torch.nn.Linear(2, 2)


class _Wrapper(torch.nn.Module):
    def __init__(self, module, config=None):
        super().__init__()
        self.module = module
        self.config = config


def test_get_attr_wrapped_model_looks_through_wrappers():
    inner = _Inner()
    wrapped = _Wrapper(_Wrapper(inner), config=None)
    assert utils.get_attr_wrapped_model(wrapped, "config") is None  # allow_none: the outer None counts
    assert utils.get_attr_wrapped_model(wrapped, "config", allow_none=False) == "inner-config"
    assert utils.get_attr_wrapped_model(wrapped, "linear", return_model_obj=True) is inner
    assert utils.get_model_config(wrapped) == "inner-config"
    assert utils.get_model_type(wrapped) == "encoder_or_decoder"
    assert utils.get_model_xattn(wrapped) is False
    with pytest.raises(RuntimeError, match=r"couldn't find attribute 'missing'"):
        utils.get_attr_wrapped_model(wrapped, "missing")
    with pytest.raises(RuntimeError, match=r"single model chunk, not a list"):
        utils.get_attr_wrapped_model([wrapped], "config")


def test_unwrap_model_strips_wrapper_types():
    inner = _Inner()
    wrapped = _Wrapper(_Wrapper(inner))
    assert utils.unwrap_model(wrapped, (_Wrapper,)) is inner
    assert utils.unwrap_model([wrapped, inner], (_Wrapper,)) == [inner, inner]
    assert utils.unwrap_model(wrapped) is wrapped  # not one of the default wrapper types


def test_unwrap_model_default_types_include_float16_module():
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1, bf16=True)
    inner = _Inner()
    assert utils.unwrap_model(Float16Module(config, inner)) is inner


def test_is_submodule_and_accepts_parameter():
    inner = _Inner()
    assert utils.is_submodule(inner.linear, inner)
    assert not utils.is_submodule(inner, inner)
    assert utils.is_submodule(inner, inner, strict=False)
    assert not utils.is_submodule(torch.nn.Linear(1, 1), inner)

    def f(a, b=1, *args, c=2):
        return a

    def g(a, **kwargs):
        return a

    assert utils.accepts_parameter(f, "b") and utils.accepts_parameter(f, "c")
    assert not utils.accepts_parameter(f, "d") and not utils.accepts_parameter(f, "args")
    assert utils.accepts_parameter(g, "anything")


def test_small_numeric_helpers():
    assert utils.round_up_to_nearest_multiple(10, 8) == 16 and utils.round_up_to_nearest_multiple(16, 8) == 16
    with pytest.raises(ValueError, match=r"7 is not divisible by 2"):
        utils.ensure_divisibility(7, 2)
    utils.ensure_divisibility(8, 2)
    torch.manual_seed(0)
    weight = torch.empty(4000, 100)
    utils.mup_scaled_init_method_normal(0.02, num_layers=8, width_mult=4.0)(weight)
    assert abs(weight.std().item() - 0.02 / (2 * 8 * 4.0) ** 0.5) < 2e-4
    assert utils.is_using_quantization_scales(type("C", (), {"fp8": "e4m3", "fp4": None})())
    assert not utils.is_using_quantization_scales(type("C", (), {"fp8": None, "fp4": None})())


# ---- viewless tensors and the memory buffer -------------------------------------------------------------------


def test_make_viewless_tensor_drops_the_base_and_keeps_the_graph():
    base = torch.arange(6.0, requires_grad=True)
    view = (base * 2).view(2, 3)
    assert view._base is not None
    with pytest.raises(AssertionError, match=r"Ensure tensor._base is None"):
        utils.assert_viewless_tensor(view)
    viewless = utils.make_viewless_tensor(view, requires_grad=True, keep_graph=True)
    assert viewless._base is None and viewless.data_ptr() == view.data_ptr()
    utils.assert_viewless_tensor([viewless, None, 3])
    viewless.sum().backward()
    assert torch.equal(base.grad, torch.full((6,), 2.0))  # the gradient passes through MakeViewlessTensor
    detached = utils.make_viewless_tensor(view, requires_grad=False, keep_graph=False)
    assert detached._base is None and detached.grad_fn is None
    plain = torch.ones(3)
    assert utils.make_viewless_tensor(plain, False, False) is plain


def test_safely_set_viewless_tensor_data():
    tensor = torch.zeros(3)
    utils.safely_set_viewless_tensor_data(tensor, torch.ones(3))
    assert torch.equal(tensor, torch.ones(3))
    with pytest.raises(AssertionError, match=r"new_data_tensor has shape"):
        utils.safely_set_viewless_tensor_data(torch.zeros(4).view(2, 2), torch.ones(2, 2))


def test_wrapped_tensor_hands_over_its_only_reference():
    wrapped = utils.WrappedTensor(torch.ones(2))
    assert torch.equal(wrapped.unwrap(), torch.ones(2))
    with pytest.raises(RuntimeError, match=r"already unwrapped"):
        wrapped.unwrap()


def test_global_memory_buffer_reuses_and_grows():
    buffer = utils.GlobalMemoryBuffer()
    small = buffer.get_tensor((2, 2), torch.float32, "a")
    again = buffer.get_tensor((4,), torch.float32, "a")
    assert again.data_ptr() == small.data_ptr()  # same name and dtype: same memory
    other_dtype = buffer.get_tensor((4,), torch.float16, "a")
    assert other_dtype.data_ptr() != small.data_ptr()
    entered = []

    class Context:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    big = buffer.get_tensor((3, 4), torch.float32, "a", mem_alloc_context=Context)
    assert big.shape == (3, 4) and entered == [True]  # the growth allocated inside the given context
    buffer.get_tensor((2,), torch.float32, "a", mem_alloc_context=Context)
    assert entered == [True]  # no reallocation for a smaller request


# ---- versions ---------------------------------------------------------------------------------------------------


def test_version_helpers_for_present_and_absent_packages():
    assert utils.get_torch_version() == utils.PkgVersion(torch.__version__)
    assert utils.is_torch_min_version("2.0.0") and not utils.is_torch_min_version("999.0")
    assert utils.is_torch_min_version(str(utils.get_torch_version()))
    assert not utils.is_torch_min_version(str(utils.get_torch_version()), check_equality=False)
    getters = {
        "transformer-engine": (utils.get_te_version, utils.is_te_min_version),
        "flash-attn": (utils.get_fa_version, utils.is_fa_min_version),
        "mamba-ssm": (utils.get_mamba_version, utils.is_mamba_min_version),
        "causal-conv1d": (utils.get_causal_conv1d_version, utils.is_causal_conv1d_min_version),
        "flashinfer-python": (utils.get_flashinfer_version, utils.is_flashinfer_min_version),
    }
    import importlib.metadata

    for distribution, (get, is_min) in getters.items():
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None:
            assert get() is None, distribution
            assert is_min("0.0.1") is False, distribution  # an absent package meets no minimum
        else:
            assert get() == utils.PkgVersion(installed)
            assert is_min("0.0.0")


# ---- decorators -------------------------------------------------------------------------------------------------


def test_deprecated_warns_with_the_details():
    @utils.deprecated(version="0.10", removal_version="0.12", alternative="new_fn", reason="renamed")
    def old_fn(x):
        return x + 1

    with pytest.warns(
        DeprecationWarning,
        match=r"old_fn is deprecated since version 0.10 and will be removed in "
        r"version 0.12; use new_fn instead \(renamed\)",
    ):
        assert old_fn(1) == 2


def test_deprecated_class_warns_on_construction():
    @utils.deprecated(version="0.9")
    class Old:
        def __init__(self, value):
            self.value = value

    with pytest.warns(DeprecationWarning, match=r"Old is deprecated since version 0.9"):
        assert Old(3).value == 3


def test_deprecate_args_warns_only_for_named_keywords():
    @utils.deprecate_args("old")
    def fn(new=None, old=None):
        return new, old

    with pytest.warns(DeprecationWarning, match=r"Argument 'old' has been deprecated"):
        assert fn(old=1) == (None, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fn(new=2) == (2, None)


def test_deprecate_inference_params():
    with pytest.warns(DeprecationWarning, match=r"`inference_params` renamed to `inference_context`"):
        assert utils.deprecate_inference_params(None, "params") == "params"
    assert utils.deprecate_inference_params("context", None) == "context"


def test_experimental_api_needs_the_flag():
    @utils.experimental_fn(introduced_with_version="0.19")
    def new_feature():
        return "ran"

    @utils.experimental_api
    class NewThing:
        pass

    core_config.set_experimental_flag(False)
    with pytest.raises(
        utils.ExperimentalNotEnabledError,
        match=r"new_feature is experimental \(introduced with "
        r"0.19\) and not enabled",
    ):
        new_feature()
    with pytest.raises(utils.ExperimentalNotEnabledError, match=r"NewThing is experimental"):
        NewThing()
    core_config.set_experimental_flag(True)
    try:
        assert new_feature() == "ran"
        assert isinstance(NewThing(), NewThing)
    finally:
        core_config.set_experimental_flag(False)


def test_experimental_cls_guards_class_and_instance_attributes():
    @utils.experimental_cls(introduced_with_version="0.19")
    class Thing:
        def method(self):
            return "method"

        @classmethod
        def build(cls):
            return "built"

    core_config.set_experimental_flag(False)
    assert Thing.is_experimental is False
    with pytest.raises(utils.ExperimentalNotEnabledError, match=r"Thing is experimental \(introduced with 0.19\)"):
        Thing.build()
    core_config.set_experimental_flag(True)
    try:
        thing = Thing()
        assert (thing.method(), Thing.build(), thing.is_experimental) == ("method", "built", True)
        assert type(Thing).__qualname__ == Thing.__qualname__ and isinstance(thing, Thing)
        core_config.set_experimental_flag(False)
        with pytest.raises(utils.ExperimentalNotEnabledError, match=r"Thing is experimental"):
            thing.method()
    finally:
        core_config.set_experimental_flag(False)


def test_have_packaging_is_true():
    assert utils.HAVE_PACKAGING is True


def test_null_and_internal_decorators_change_nothing():
    def fn():
        return 1

    assert utils.null_decorator(fn) is fn
    assert utils.null_decorator("anything", key=1)(fn) is fn
    assert utils.internal_api(fn) is fn and fn._internal_api


def test_trace_async_exceptions_logs_and_reraises(caplog):
    @utils.trace_async_exceptions
    async def fails():
        raise KeyError("boom")

    @utils.trace_async_exceptions(verbose=True)
    async def numbers():
        yield 1
        yield 2

    async def collect():
        return [n async for n in numbers()]

    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.INFO, logger="megatron.core.utils"):
            with pytest.raises(KeyError, match="boom"):
                loop.run_until_complete(fails())
            assert loop.run_until_complete(collect()) == [1, 2]
    finally:
        loop.close()
    assert "exception in test_trace_async_exceptions_logs_and_reraises.<locals>.fails" in caplog.text
    assert "KeyError: 'boom'" in caplog.text
    assert "entering" in caplog.text and "leaving" in caplog.text
    with pytest.raises(TypeError, match=r"decorates async functions"):
        utils.trace_async_exceptions(lambda: None)


def test_get_asyncio_loop():
    given = asyncio.new_event_loop()
    try:
        assert utils.get_asyncio_loop(given) is given
    finally:
        given.close()
    loop = utils.get_asyncio_loop()
    assert isinstance(loop, asyncio.AbstractEventLoop) and not loop.is_closed()

    async def inside():
        return utils.get_asyncio_loop()

    assert loop.run_until_complete(inside()) is loop


# ---- profiling ranges -------------------------------------------------------------------------------------------


def test_nvtx_ranges_are_noops_when_disabled_and_profiler_ranges_when_enabled():
    utils.configure_nvtx_profiling(False)
    utils.nvtx_range_pop()  # disabled: nothing is checked
    utils.configure_nvtx_profiling(True)
    try:

        @utils.nvtx_decorator("decorated")
        def work():
            return torch.ones(4).sum()

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            utils.nvtx_range_push("outer", suffix="step")
            work()
            utils.nvtx_range_pop("outer", suffix="step")
        if not torch.cuda.is_available():
            names = {event.name for event in profile.events()}
            assert {"outer.step", "decorated"} <= names
        utils.nvtx_range_push("a")
        with pytest.raises(RuntimeError, match=r"innermost open range is 'a'"):
            utils.nvtx_range_pop("b")
        with pytest.raises(RuntimeError, match=r"without a matching nvtx_range_push"):
            utils.nvtx_range_pop()
    finally:
        utils.configure_nvtx_profiling(False)


# ---- multi-tensor stand-ins -------------------------------------------------------------------------------------


def test_local_multi_tensor_helpers():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    total, per_tensor = utils.local_multi_tensor_applier(
        utils.local_multi_tensor_l2_norm, torch.zeros(1, dtype=torch.int), [tensors], True
    )
    assert torch.allclose(total, torch.tensor([13.0])) and torch.allclose(per_tensor, torch.tensor([5.0, 12.0]))
    total, none = utils.local_multi_tensor_l2_norm(0, None, [tensors], False)
    assert none is None and total.shape == (1,)
    targets = [torch.zeros(2), torch.zeros(1)]
    utils.local_multi_tensor_applier(utils.local_multi_tensor_scale, None, [tensors, targets], 0.5)
    assert torch.equal(targets[0], torch.tensor([1.5, 2.0])) and torch.equal(targets[1], torch.tensor([6.0]))


# ---- batches ----------------------------------------------------------------------------------------------------


def _cp_split(cp_size):
    ps.initialize_model_parallel(context_parallel_size=cp_size)
    seq = 4 * cp_size
    tokens = torch.arange(2 * seq).view(2, seq)
    batch = {
        "tokens": tokens,
        "labels": tokens + 100,
        "attention_mask": torch.arange(seq * seq).view(1, 1, seq, seq),
        "cu_seqlens": torch.tensor([0, seq]),
        "loss_mask": None,
    }
    return utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False)


def _expected_zigzag(cp_size, cp_rank, values_along_seq):
    chunks = values_along_seq.chunk(2 * cp_size, dim=-1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=-1)


def test_get_batch_on_this_cp_rank_zigzag_split():
    cp_size = 2
    for rank, split in enumerate(run_distributed(cp_size, _cp_split, cp_size)):
        seq = 4 * cp_size
        tokens = torch.arange(2 * seq).view(2, seq)
        assert torch.equal(split["tokens"], _expected_zigzag(cp_size, rank, tokens))
        assert torch.equal(split["labels"], _expected_zigzag(cp_size, rank, tokens + 100))
        mask = torch.arange(seq * seq).view(1, 1, seq, seq)
        expected_mask = _expected_zigzag(cp_size, rank, mask.transpose(2, 3)).transpose(2, 3)
        assert torch.equal(split["attention_mask"], expected_mask)  # split along dim 2 (queries)
        assert torch.equal(split["cu_seqlens"], torch.tensor([0, seq]))
        assert split["loss_mask"] is None
    # rank 0 of CP=2 keeps chunks 0 and 3 of [0..7]: tokens 0,1 and 6,7.
    assert split["tokens"][0].tolist() == [2, 3, 4, 5]  # rank 1: chunks 1 and 2


def test_get_batch_on_this_cp_rank_without_cp_and_refusals():
    batch = {"tokens": torch.arange(6).view(1, 6)}
    ps.destroy_model_parallel()
    assert utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False) is batch
    with pytest.raises(ValueError, match=r"not supported yet: hybrid context parallelism \(is_hybrid_cp=True\)"):
        utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=True)
    with pytest.raises(ValueError, match=r"not supported yet: per-sequence CP load balancing"):
        utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, use_per_sequence_balancing=True)


def _cp_split_bad_length():
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        utils.get_batch_on_this_cp_rank({"tokens": torch.zeros(1, 6)}, is_hybrid_cp=False)
    except ValueError as error:
        return str(error)
    return ""


def test_get_batch_on_this_cp_rank_needs_divisible_length():
    for message in run_distributed(2, _cp_split_bad_length):
        assert "sequence length 6 along dim 1, not divisible by 2 x context_parallel_size = 4" in message


def test_prepare_input_tensors_for_wgrad_compute():
    grad, inp = utils.prepare_input_tensors_for_wgrad_compute(torch.ones(3, 2, 5), torch.ones(3, 2, 4))
    assert grad.shape == (6, 5) and inp.shape == (6, 4)


def test_drain_embedding_wgrad_compute_accumulates_deferred_gradients():
    class Config:
        sequence_parallel = False
        gradient_accumulation_fusion = True

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 4))
    weight.main_grad = torch.zeros(5, 4)
    inputs = [torch.randn(3, 2, 4) for _ in range(2)]
    grads = [torch.randn(3, 2, 5) for _ in range(2)]
    activations, grad_outputs = list(inputs), list(grads)
    utils.drain_embedding_wgrad_compute(Config(), activations, grad_outputs, weight, tp_group=None)
    expected = sum(g.reshape(-1, 5).t() @ x.reshape(-1, 4) for g, x in zip(grads, inputs))
    assert torch.allclose(weight.main_grad, expected, atol=1e-6)
    assert activations == [] and grad_outputs == []
    Config.gradient_accumulation_fusion = False
    utils.drain_embedding_wgrad_compute(Config(), list(inputs), list(grads), weight, tp_group=None)
    assert torch.allclose(weight.grad, expected, atol=1e-6)


# ---- process-group helpers and checkpoint helpers ---------------------------------------------------------------


def _pg_helpers_and_sharded_tensors():
    ps.initialize_model_parallel(2)
    tp = ps.get_tensor_model_parallel_group()
    replicated = utils.make_sharded_tensor_for_checkpoint(torch.ones(4), "bias")
    split = utils.make_tp_sharded_tensor_for_checkpoint(torch.ones(3, 4), "weight", tp_axis=0)
    stacked = utils.make_tp_sharded_tensor_for_checkpoint(
        torch.ones(3, 4), "layers", tp_axis=1, prepend_offsets=[(0, 1, 2)]
    )
    return {
        "pg": (utils.get_pg_size(tp), utils.get_pg_rank(tp), utils.get_pg_src_rank(tp), utils.get_pg_size()),
        "tp_fallback": utils.get_tensor_model_parallel_group_if_none(None) is tp,
        "expert_fallback": utils.get_tensor_model_parallel_group_if_none(None, is_expert=True)
        is ps.get_expert_tensor_parallel_group(),
        "explicit": utils.get_tensor_model_parallel_group_if_none("given") == "given",
        "replicated": (replicated.global_shape, replicated.global_offset, replicated.replica_id),
        "split": (split.global_shape, split.global_offset, split.replica_id),
        "stacked": (stacked.global_shape, stacked.global_offset),
    }


def test_pg_helpers_and_sharded_tensor_helpers():
    results = run_distributed(4, _pg_helpers_and_sharded_tensors)
    for rank, result in enumerate(results):
        tp_rank, dp_rank = rank % 2, rank // 2
        assert result["pg"] == (2, tp_rank, rank - tp_rank, 4)
        assert result["tp_fallback"] and result["expert_fallback"] and result["explicit"]
        assert result["replicated"] == ((4,), (0,), (0, tp_rank, dp_rank))
        assert result["split"] == ((6, 4), (3 * tp_rank, 0), (0, 0, dp_rank))
        assert result["stacked"] == ((2, 3, 8), (1, 0, 4 * tp_rank))


def test_pg_helpers_without_torch_distributed():
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    assert (utils.get_pg_size(), utils.get_pg_rank(), utils.get_pg_src_rank()) == (1, 0, 0)


def _log_on_each_stage():
    ps.initialize_model_parallel(2, 2)
    logger = logging.getLogger("stage-test")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    utils.log_on_each_pipeline_stage(logger, logging.INFO, "hello")
    logger.removeHandler(handler)
    return len(records)


def test_log_on_each_pipeline_stage_logs_once_per_stage():
    counts = run_distributed(8, _log_on_each_stage)
    # tp=2, pp=2, dp=2: stage s is ranks 4s..4s+3; only tp rank 0 of dp rank 0 logs: ranks 0 and 4.
    assert counts == [1, 0, 0, 0, 1, 0, 0, 0]


# ---- diagnostics ------------------------------------------------------------------------------------------------


def _param_hashes(corrupt):
    ps.initialize_model_parallel(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    if corrupt and dist.get_rank() == 1:
        with torch.no_grad():
            model.weight[0, 0] += 1
    return utils.check_param_hashes_across_dp_replicas([model]), utils.check_param_hashes_across_dp_replicas(
        [model], cross_check=True
    )


def test_check_param_hashes_across_dp_replicas():
    assert run_distributed(2, _param_hashes, False) == [(True, True), (True, True)]
    assert run_distributed(2, _param_hashes, True) == [(False, False), (False, False)]


def _straggler_report():
    detector = utils.StragglerDetector()
    assert not detector.configured and not detector.enabled
    with detector:  # disabled: nothing timed
        pass
    detector.configure(dist.get_world_size(), dist.get_rank(), mmcnt=1, amp=1.5, enabled=True)
    import time

    with detector(bdata=True):
        time.sleep(0.01)
    with detector:
        time.sleep(0.2 if dist.get_rank() == 1 else 0.02)
    reported = detector.report(total_flops=1e9, log_interval=1)
    after = detector.elapsed()
    return reported, getattr(detector, "last_report", None), after, (detector.my_rank, detector.world_size)


def test_straggler_detector_names_the_slow_rank():
    results = run_distributed(3, _straggler_report)
    reported = [r[0] for r in results]
    assert reported == [True, False, False]
    summary = results[0][1]
    assert summary["slowest"][0][0] == 1 and summary["stragglers"] == [1]
    assert summary["fastest"][0][0] in (0, 2)
    assert all(r[2][:2] == (0.0, 0.0) for r in results)  # elapsed() resets
    assert [r[3] for r in results] == [(0, 3), (1, 3), (2, 3)]


def test_straggler_detector_elapsed_reports_compute_and_data_time():
    detector = utils.StragglerDetector()
    detector.configure(1, 0, enabled=True)
    import time

    with detector:
        time.sleep(0.02)
    with detector(bdata=True):
        time.sleep(0.01)
    compute_ms, batch_ms, temp, power, util, clock = detector.elapsed()
    assert compute_ms >= 15 and 5 <= batch_ms < compute_ms
    assert (temp, power, util, clock) == (0, 0, 0, 0)
    with pytest.raises(ValueError, match=r"mmcnt must be >= 1"):
        detector.configure(1, 0, mmcnt=0)


def _tp_broadcast(pp_size, stage, mtp, with_mask, with_cu_seqlens):
    ps.initialize_model_parallel(2)
    tp_rank = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(1)
    full = {
        "tokens": torch.randint(0, 50, (2, 4)),
        "labels": torch.randint(0, 50, (2, 4)),
        "loss_mask": torch.rand(2, 4),
        "position_ids": torch.arange(4).repeat(2, 1),
        "attention_mask": torch.rand(2, 1, 4, 4) > 0.5,
        "cu_seqlens": torch.tensor([0, 3, 8]),
        "max_seqlen": 5,
    }
    received = utils.get_batch_on_this_tp_rank(
        full if tp_rank == 0 else {},
        has_cu_seqlens=with_cu_seqlens,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=with_mask,
        broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(),
        broadcast_group=ps.get_tensor_model_parallel_group(),
        cp_size=1,
        tp_rank=tp_rank,
        micro_batch_size=2,
        seq_length=4,
        mtp_on_this_rank=mtp,
        pipeline_model_parallel_size=pp_size,
        is_pipeline_first_stage=stage == "first",
        is_pipeline_last_stage=stage == "last",
    )

    def same(key, value):
        sent = torch.as_tensor(full[key]).to(value.dtype).reshape(value.shape)
        return bool(torch.equal(value, sent))

    return {key: None if value is None else same(key, value) for key, value in received.items()}


@pytest.mark.parametrize(
    "pp_size, stage, mtp, with_mask, present",
    [
        (1, None, False, True, {"tokens", "labels", "loss_mask", "position_ids", "attention_mask"}),
        (2, "first", False, False, {"tokens", "position_ids"}),
        (2, "last", False, True, {"labels", "loss_mask", "attention_mask"}),
        (2, "last", True, False, {"labels", "loss_mask", "tokens", "position_ids"}),
        (2, None, False, True, set()),
    ],
)
def test_get_batch_on_this_tp_rank_sends_what_each_stage_needs(pp_size, stage, mtp, with_mask, present):
    for result in run_distributed(2, _tp_broadcast, pp_size, stage, mtp, with_mask, False):
        assert {key for key, same in result.items() if same is not None} == present
        assert all(same for same in result.values() if same is not None)


def test_get_batch_on_this_tp_rank_packed_sequences_and_refusal():
    for result in run_distributed(2, _tp_broadcast, 1, None, False, False, True):
        assert result["cu_seqlens"] and result["max_seqlen"] and result["tokens"]
    with pytest.raises(ValueError, match=r"not supported yet: hybrid context parallelism"):
        utils.get_batch_on_this_tp_rank({}, False, True, False, 0, None, 1, 0, 1, 4, False)
