"""ModelConfig's _target_ dicts, the allow-list on reading them, compose_hooks and the shared error type."""

from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models import GPTModelConfig, ModelConfig, Serializable, compose_hooks
from megatron.training.models.base import ModelConfigError


@dataclass
class Inner:
    depth: int = 1


@dataclass
class ToyConfig(ModelConfig):
    builder: ClassVar[str] = "megatron.training.models.gpt.GPTModelBuilder"
    width: int = 4
    inner: Inner = field(default_factory=Inner)


def _gpt():
    return GPTModelConfig(
        transformer=TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2), vocab_size=100
    )


def test_gpt_config_round_trips_with_its_transformer():
    config = _gpt()
    config.pre_wrap_hooks = [lambda model: model]
    data = config.as_dict()
    assert data["_target_"] == "megatron.training.models.gpt.GPTModelConfig"
    assert data["_builder_"] == "megatron.training.models.gpt.GPTModelBuilder"
    assert data["transformer"]["_target_"].endswith("TransformerConfig") and data["transformer"]["hidden_size"] == 16
    assert "pre_wrap_hooks" not in data and "post_wrap_hooks" not in data
    back = ModelConfig.from_dict(data)
    assert isinstance(back, GPTModelConfig) and back.vocab_size == 100 and back.hidden_size == 16
    assert isinstance(back, Serializable)


def test_round_trip_of_a_config_defined_by_the_program():
    back = ModelConfig.from_dict({**ToyConfig(width=9, inner=Inner(depth=3)).as_dict(), "stale_key": 1})
    assert isinstance(back, ToyConfig) and back.width == 9 and back.inner == Inner(depth=3)
    assert back.get_builder_cls().__name__ == "GPTModelBuilder"


def test_missing_target_is_refused():
    with pytest.raises(ValueError, match="without '_target_'"):
        ModelConfig.from_dict({"width": 1})


def test_target_outside_the_allow_list_is_not_imported():
    with pytest.raises(ValueError, match=r"'antigravity\.Thing' is not allowed.*target_allowlist\.add_prefix"):
        ModelConfig.from_dict({"_target_": "antigravity.Thing"})


def test_target_that_is_not_a_dataclass_is_refused():
    with pytest.raises(ValueError, match="does not name a dataclass"):
        ModelConfig.from_dict({"_target_": "torch.nn.Linear"})


def test_compose_hooks_runs_in_order():
    assert compose_hooks([lambda x: x + [1], lambda x: x + [2]])([0]) == [0, 1, 2]
    assert compose_hooks([])("same") == "same"


def test_model_config_error_is_caught_as_either_type():
    assert issubclass(ModelConfigError, ValueError) and issubclass(ModelConfigError, AssertionError)


def test_gpt_config_travels_in_a_pretrain_container_yaml(tmp_path):
    from megatron.core.optimizer import OptimizerConfig
    from megatron.training import config as cfg

    container = cfg.PretrainConfigContainer(
        train=cfg.TrainingConfig(),
        model=_gpt(),
        optimizer=OptimizerConfig(),
        scheduler=cfg.SchedulerConfig(),
        logger=cfg.LoggerConfig(),
        checkpoint=cfg.CheckpointConfig(),
    )
    container.to_yaml(str(tmp_path / "run.yaml"))
    model = cfg.PretrainConfigContainer.from_yaml(str(tmp_path / "run.yaml")).model
    assert isinstance(model, GPTModelConfig) and model.vocab_size == 100 and model.hidden_size == 16
