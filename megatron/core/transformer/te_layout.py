"""This project's PyTorch modules with Transformer Engine's checkpoint layout, for the Transformer Engine layer specs.

Megatron's ``--transformer-impl transformer_engine`` (its default, and what nearly every Megatron checkpoint was
written with) builds Transformer Engine modules. Transformer Engine is not used here; these modules compute what the
local ones compute and keep Transformer Engine's parameter names and extra state, so checkpoints move both ways
without conversion:

- the norm in front of the QKV projection and of a dense MLP's fc1 lives inside that linear
  (:class:`TELayoutLayerNormColumnParallelLinear`: ``layer_norm_weight`` / ``layer_norm_bias``), in ``state_dict()``
  as well as in distributed checkpoints;
- every linear, every norm and core attention has an ``_extra_state`` entry holding Transformer Engine's FP8
  metadata, which for a run without FP8 is an empty ``uint8`` tensor (what these modules write). Distributed
  checkpoints store it as a ShardedObject, except core attention's, which Megatron leaves out of them;
- extra state read back is not used (without FP8 there is nothing to restore), and a missing one is not an error.
"""

import logging

import torch

from megatron.core.tensor_parallel.fp8_linear import fp8_extra_state, load_fp8_extra_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.grouped_linear import ColumnParallelGroupedLinear, RowParallelGroupedLinear
from megatron.core.transformer.torch_norm import LayerNorm, RMSNorm, WrappedTorchNorm, normalize
from megatron.core.utils import get_te_version

logger = logging.getLogger(__name__)

_EXTRA_STATE = "_extra_state"
_announced = False


def announce_te_layout() -> None:
    """Say, once per process, which modules a Transformer Engine layer spec builds here."""
    global _announced
    if _announced:
        return
    _announced = True
    if get_te_version() is None:
        reason = "Transformer Engine is not installed"
    else:
        reason = "this project does not run Transformer Engine's kernels"
    logger.warning(
        "Transformer Engine layer spec: %s, so the layers are this project's PyTorch modules with Transformer "
        "Engine's checkpoint keys (fused layer_norm_weight / layer_norm_bias, _extra_state); checkpoints load and "
        "save in the transformer_engine layout",
        reason,
    )


class _TEExtraState:
    """Transformer Engine's extra state: an empty byte tensor without FP8 scaling state, else the delayed-scaling
    state (a dict of tensors, not Transformer Engine's pickled bytes, which are never unpickled here)."""

    def get_extra_state(self):
        state = fp8_extra_state(self)
        return torch.empty(0, dtype=torch.uint8) if state is None else state

    def set_extra_state(self, state) -> None:
        """Restore this project's delayed FP8 scaling state; anything else (Transformer Engine's) is not used."""
        load_fp8_extra_state(self, state)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # Checkpoints of the local spec, and distributed checkpoints for core attention, have no entry.
        state_dict.setdefault(f"{prefix}{_EXTRA_STATE}", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class TELayoutColumnParallelLinear(_TEExtraState, ColumnParallelLinear):
    """ColumnParallelLinear with Transformer Engine's extra state (Megatron's ``TEColumnParallelLinear`` layout)."""


class TELayoutRowParallelLinear(_TEExtraState, RowParallelLinear):
    """RowParallelLinear with Transformer Engine's extra state (Megatron's ``TERowParallelLinear`` layout)."""


class TELayoutLayerNormColumnParallelLinear(TELayoutColumnParallelLinear):
    """``config.normalization`` of the input, then the column-parallel linear: Megatron's
    ``TELayerNormColumnParallelLinear`` layout, with the norm's parameters as ``layer_norm_weight`` (and, for
    LayerNorm, ``layer_norm_bias``) replicated over tensor-parallel ranks. Takes ColumnParallelLinear's arguments.

    The norm is applied to this rank's input before any sequence-parallel gather (it acts on each token alone), and
    its parameters are marked ``sequence_parallel`` as a separate norm's are.
    """

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        # The separate norm the local spec builds, so both specs validate and initialise the norm the same way.
        norm = WrappedTorchNorm(config=config, hidden_size=input_size, eps=config.layernorm_epsilon)
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = norm.zero_centered_gamma
        # Transformer Engine registers the norm's parameters before the linear's: that order is the order of the
        # distributed optimizer's buckets, which its dp_reshardable checkpoints depend on.
        linear_parameters = dict(self._parameters)
        self._parameters.clear()
        self.layer_norm_weight = norm.weight
        self.layer_norm_bias = getattr(norm, "bias", None)
        self._parameters.update(linear_parameters)

    def forward(self, input_: torch.Tensor, weight=None, runtime_gather_output=None):
        normed = normalize(
            input_, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma
        )
        return super().forward(normed, weight, runtime_gather_output)


class _TELayoutLayerNorm(_TEExtraState, LayerNorm):
    pass


class _TELayoutRMSNorm(_TEExtraState, RMSNorm):
    pass


class TELayoutNorm(WrappedTorchNorm):
    """WrappedTorchNorm's LayerNorm / RMSNorm with Transformer Engine's extra state (Megatron's ``TENorm``
    layout): the final norm, q/k norms and an MoE layer's pre-MLP norm."""

    _layer_norm_class = _TELayoutLayerNorm
    _rms_norm_class = _TELayoutRMSNorm


class TELayoutDotProductAttention(_TEExtraState, DotProductAttention):
    """DotProductAttention with Transformer Engine's extra state in ``state_dict()``; as Megatron's
    ``TEDotProductAttention`` does, it adds nothing to distributed checkpoints."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        sharded_state_dict.pop(f"{prefix}{_EXTRA_STATE}", None)
        return sharded_state_dict


class TELayoutColumnParallelGroupedLinear(_TEExtraState, ColumnParallelGroupedLinear):
    """Grouped fc1 with Transformer Engine's extra state (Megatron's ``TEColumnParallelGroupedLinear`` layout)."""


class TELayoutRowParallelGroupedLinear(_TEExtraState, RowParallelGroupedLinear):
    """Grouped fc2 with Transformer Engine's extra state (Megatron's ``TERowParallelGroupedLinear`` layout)."""
