"""``get_gpt_heterogeneous_layer_spec`` under Megatron-Core's name; refused, as heterogeneous configs are."""

from megatron.core.transformer.heterogeneous.heterogeneous_config import NOT_SUPPORTED


def get_gpt_heterogeneous_layer_spec(config, use_te: bool = False, vp_stage=None, pp_rank=None):
    """The block spec of a heterogeneous config: refused, with the reason and what to use instead."""
    raise ValueError(NOT_SUPPORTED)
