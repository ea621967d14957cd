"""The config dataclasses and the two top-level containers: YAML round trips, checks, and the runtime
inference config."""

import importlib.util
import signal
from types import SimpleNamespace

import pytest

from megatron.core.inference.config import InferenceConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.training.config import (
    CheckpointConfig,
    DistributedInitConfig,
    FaultInjectorConfig,
    InferenceConfigContainer,
    InferenceSetupConfig,
    LoggerConfig,
    PretrainConfigContainer,
    SchedulerConfig,
    StragglerDetectionConfig,
    TrainingConfig,
)


def pretrain_config():
    return PretrainConfigContainer(
        train=TrainingConfig(micro_batch_size=2, train_iters=5, exit_signal=signal.SIGINT),
        model={"num_layers": 2},
        optimizer=OptimizerConfig(lr=1e-3),
        scheduler=SchedulerConfig(lr_decay_style="cosine"),
        logger=LoggerConfig(),
        checkpoint=CheckpointConfig(save="/tmp/ckpt"),
        straggler=StragglerDetectionConfig(log_straggler=True),
    )


def test_pretrain_container_yaml_round_trip(tmp_path):
    config = pretrain_config()
    path = str(tmp_path / "pretrain.yaml")
    config.to_yaml(path)
    back = PretrainConfigContainer.from_yaml(path)
    assert back.to_dict() == config.to_dict()
    assert back.train.exit_signal is signal.SIGINT
    assert back.scheduler.lr_decay_style == "cosine" and back.optimizer.lr == 1e-3
    assert back.straggler.log_straggler and back.checkpoint.save == "/tmp/ckpt"


def test_computed_scheduler_fields_are_dropped_when_read_back():
    data = pretrain_config().to_dict()
    data["scheduler"]["lr_decay_steps"] = 1000  # computed when the scheduler is built; not a setting
    assert PretrainConfigContainer.from_dict(data).scheduler.lr_decay_steps is None


def test_checkpoint_config_checks():
    assert CheckpointConfig().async_strategy == "mcore"  # synchronous saves do not use nvrx
    assert CheckpointConfig(async_save=True).async_strategy == "nvrx"
    with pytest.raises(ValueError, match="CheckpointConfig.async_strategy is 'fast'; choose 'nvrx' or 'mcore'"):
        CheckpointConfig(async_strategy="fast")
    with pytest.raises(ValueError, match="verify_integrity needs ckpt_format='torch_dist', got 'torch'"):
        CheckpointConfig(verify_integrity=True, ckpt_format="torch")


@pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is not None, reason="nvrx is installed")
def test_nvrx_async_save_needs_the_extension():
    with pytest.raises(ValueError, match="needs nvidia-resiliency-ext .* or set async_strategy='mcore'"):
        CheckpointConfig(async_save=True, ckpt_format="torch_dcp")


def test_local_rank_comes_from_the_launcher(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert DistributedInitConfig().local_rank == 3
    monkeypatch.delenv("LOCAL_RANK")
    assert DistributedInitConfig().local_rank == 0


def test_fault_injector_config_is_reexported():
    assert FaultInjectorConfig().fault_injector_ranks is None


def inference_container(**setup):
    return InferenceConfigContainer(
        model={"num_layers": 2}, checkpoint=CheckpointConfig(load="/ckpt"), inference=InferenceSetupConfig(**setup)
    )


def test_inference_container_round_trip(tmp_path):
    config = inference_container(inference_max_requests=4)
    path = str(tmp_path / "inference.yaml")
    config.to_yaml(path)
    back = InferenceConfigContainer.from_yaml(path)
    assert back.inference.inference_max_requests == 4 and back.checkpoint.load == "/ckpt"


def test_to_inference_config_caps_learned_positions_at_the_model_limit():
    model = SimpleNamespace(position_embedding_type="learned_absolute", max_sequence_length=1024)
    setup = InferenceSetupConfig(inference_dynamic_batching_max_requests=16, inference_dynamic_batching_block_size=64)
    runtime = setup.to_inference_config(model)
    assert isinstance(runtime, InferenceConfig)
    assert (runtime.max_sequence_length, runtime.max_requests, runtime.block_size_tokens) == (1024, 16, 64)
    rope = SimpleNamespace(position_embedding_type="rope", max_sequence_length=1024)
    assert InferenceSetupConfig().to_inference_config(rope).max_sequence_length == 2560


def test_to_inference_config_refusals():
    model = SimpleNamespace(position_embedding_type="learned_absolute", max_sequence_length=8)
    with pytest.raises(ValueError, match="max_requests=16 exceeds the model's max_sequence_length=8"):
        InferenceSetupConfig(inference_dynamic_batching_max_requests=16).to_inference_config(model)
    with pytest.raises(ValueError, match=r"\['kv_cache_management_mode', 'metrics_writer'\] are not supported"):
        InferenceSetupConfig().to_inference_config(model, kv_cache_management_mode="offload", metrics_writer=object())
