"""Model configuration for the config containers (only the ``Serializable`` protocol so far)."""

from megatron.training.models.base import Serializable
