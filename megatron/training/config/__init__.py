"""Config containers (``megatron.training.config``): dataclass configs that read and write themselves as
``_target_`` dicts and YAML files, instantiated through an allow-list of importable targets."""

from megatron.training.config.container import ConfigContainerBase
from megatron.training.config.instantiate_utils import TargetAllowlist, target_allowlist
