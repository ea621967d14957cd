"""Tiny Mamba mixers and layers for the ssm tests, and whole (TP-gathered) views of their parameters."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

HIDDEN, SEQ, BATCH = 16, 12, 2
# d_inner = 2 * 16 = 32, heads = 32 / 4 = 8, groups 4: splits over TP 1, 2 and 4.
MAMBA_SIZES = dict(mamba_state_dim=8, mamba_head_dim=4, mamba_num_groups=4)
MIXER_SUBMODULES = MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)


def config(tp: int = 1, **overrides) -> TransformerConfig:
    fields = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        is_hybrid_model=True,
        **MAMBA_SIZES,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def layer_spec(**mixer_params) -> ModuleSpec:
    """The local (no Transformer Engine) spec of a Mamba layer, its norm stored under the fused TE name."""
    return ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(module=MambaMixer, submodules=MIXER_SUBMODULES, params=mixer_params),
            mamba_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"},
        ),
    )


def build_mixer(tp: int, seed: int, config_overrides=None, **mixer_params) -> MambaMixer:
    Utils.initialize_model_parallel(tp)
    torch.manual_seed(seed)
    return MambaMixer(config(tp, **(config_overrides or {})), MIXER_SUBMODULES, d_model=HIDDEN, **mixer_params)


def build_layer(tp: int, seed: int, **mixer_params) -> MambaLayer:
    Utils.initialize_model_parallel(tp)
    torch.manual_seed(seed)
    return build_module(layer_spec(**mixer_params), config=config(tp), layer_number=1)


def _gather(tensor: torch.Tensor) -> list:
    group = parallel_state.get_tensor_model_parallel_group()
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def _segmented(pieces: list, local_sections: list) -> torch.Tensor:
    """Reassemble ranks' ``[seg0_r | seg1_r | ...]`` into ``[seg0 | seg1 | ...]``."""
    per_rank = [torch.split(piece, local_sections, dim=0) for piece in pieces]
    return torch.cat([torch.cat([rank[i] for rank in per_rank]) for i in range(len(local_sections))])


def whole(mixer: MambaMixer, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of mixer parameter ``name`` (or its gradient) from every TP rank's part."""
    tp = mixer.tp_size
    pieces = _gather(tensor.detach())
    if name.startswith("in_proj."):
        return _segmented(pieces, [size // tp for size in mixer.in_proj_sections])
    if name.startswith("conv1d."):
        return _segmented(pieces, [size // tp for size in mixer.conv_sections])
    if name == "out_proj.weight":
        return torch.cat(pieces, dim=1)
    if name == "out_proj.bias":
        return pieces[0]
    return torch.cat(pieces, dim=0)


def whole_parameters(mixer: MambaMixer, grads: bool = False) -> dict:
    return {name: whole(mixer, name, param.grad if grads else param) for name, param in mixer.named_parameters()}
