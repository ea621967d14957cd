"""``HeterogeneousTransformerConfig`` (Megatron-Core's per-layer configuration, ``--heterogeneous-layers-config-path``)
exists so that code naming it imports; constructing one is refused, since megatron-lite builds every layer of a
block from one ``TransformerConfig``."""

from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

NOT_SUPPORTED = (
    "not supported yet: heterogeneous layer configurations (HeterogeneousTransformerConfig, "
    "--heterogeneous-layers-config-path / --heterogeneous-layers-config-encoded-json); "
    "use a TransformerConfig, whose settings apply to every layer"
)


@dataclass
class HeterogeneousTransformerConfig(TransformerConfig):
    """A transformer whose layers each have their own configuration (refused: see the module docstring)."""

    def __post_init__(self) -> None:
        raise ValueError(NOT_SUPPORTED)
