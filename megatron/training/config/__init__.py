"""Config containers (``megatron.training.config``): dataclass configs that read and write themselves as
``_target_`` dicts and YAML files, instantiated through an allow-list of importable targets."""

from megatron.training.config.common_config import DistributedInitConfig, ProfilingConfig, RNGConfig
from megatron.training.config.container import (
    ConfigContainerBase,
    InferenceConfigContainer,
    PretrainConfigContainer,
)
from megatron.training.config.inference_config import InferenceSetupConfig
from megatron.training.config.instantiate_utils import TargetAllowlist, target_allowlist
from megatron.training.config.resilience_config import (
    FaultInjectorConfig,
    RerunStateMachineConfig,
    StragglerDetectionConfig,
)
from megatron.training.config.training_config import (
    CheckpointConfig,
    LoggerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)
