"""HybridStack: this pipeline stage's slice of a hybrid pattern (Mamba, attention and MLP layers, one module each),
and the final norm on the last stage."""

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.fp8.context import fp8_layer_context
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, refuse_layer_types_not_built
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.config_validation import require_model_sizes
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import WrappedTensor, layout_independent_init


@dataclass
class HybridStackSubmodules:
    """The layer spec of each layer type (``gdn``, ``dsa`` and ``mla`` layers are not built here yet)."""

    mamba_layer: Union[ModuleSpec, type] = IdentityOp
    gdn_layer: Union[ModuleSpec, type] = IdentityOp
    attention_layer: Union[ModuleSpec, type] = IdentityOp
    dsa_layer: Union[ModuleSpec, type] = IdentityOp
    mla_layer: Union[ModuleSpec, type] = IdentityOp
    mlp_layer: Union[ModuleSpec, type] = IdentityOp
    moe_layer: Union[ModuleSpec, type] = IdentityOp
    mtp_block_spec: Optional[ModuleSpec] = None


class HybridStack(MegatronModule):
    """The layers of ``layer_type_list`` (symbols of :class:`Symbols`) for one pipeline stage; ``[s, b, h]`` in and
    out.

    Layer ``i`` of the stage is the model's layer ``pp_layer_offset + i`` (0-based): its ``layer_number`` is
    ``pp_layer_offset + i + 1``, its weights come from that layer's init stream and it is checkpointed as
    ``layers.<pp_layer_offset + i>.``, so neither depends on the pipeline layout. Attention, MLP and MoE layers are
    :class:`TransformerLayer` s with only that sublayer (an MoE layer's MLP is an :class:`MoELayer` built from the
    config's MoE fields; its experts are expert-parallel). On a stage without ``pre_process`` the input comes from
    :meth:`set_input_tensor`; with ``post_process`` (and ``post_layer_norm``) the final norm ``final_norm`` is
    applied.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: HybridStackSubmodules,
        pre_process: bool = True,
        layer_type_list: Optional[list[str]] = None,
        pp_layer_offset: int = 0,
        post_layer_norm: bool = True,
        post_process: bool = True,
        device=None,
        dtype=None,
        pg_collection: ProcessGroupCollection = None,
        is_mtp_layer: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__(config)
        require_model_sizes(config, "HybridStack")
        if device is not None and torch.device(device).type == "meta":
            raise ValueError("not supported yet: building a HybridStack on the meta device (device='meta')")
        if is_mtp_layer:
            raise ValueError("not supported yet: multi-token prediction (HybridStack(is_mtp_layer=True))")
        if config.cpu_offloading or config.fine_grained_activation_offloading:
            raise ValueError(
                "not supported yet: activation offloading in hybrid (Mamba) models (cpu_offloading / "
                "fine_grained_activation_offloading; --cpu-offloading-num-layers, --fine-grained-activation-"
                "offloading); GPT models support both"
            )
        if config.recompute_granularity == "full":
            raise ValueError(
                "not supported yet: recompute_granularity='full' for hybrid models (--recompute-granularity full); "
                "use 'selective' (attention's core) or no recomputation"
            )
        if config.pipeline_model_parallel_layout is not None:
            raise ValueError(
                "pipeline_model_parallel_layout (--pipeline-model-parallel-layout) places GPT layers; a hybrid "
                "model's pipeline stages come from '|' in its layer pattern (--hybrid-layer-pattern), so unset it"
            )
        layer_type_list = list(layer_type_list or [])
        refuse_layer_types_not_built("".join(layer_type_list), flag="layer_type_list")
        if Symbols.MOE in layer_type_list and not config.num_moe_experts:
            raise ValueError(
                f"layer_type_list {''.join(layer_type_list)!r} has MoE layers ('E') but config.num_moe_experts is "
                f"{config.num_moe_experts!r}; set num_moe_experts (--num-experts) or use '-' (MLP) layers"
            )
        self.submodules = submodules
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.layer_type_list = layer_type_list
        self.pp_layer_offset = pp_layer_offset
        self.pg_collection = pg_collection
        self.name = name
        self.input_tensor = None

        self.layers = torch.nn.ModuleList()
        for index, symbol in enumerate(layer_type_list):
            layer_number = pp_layer_offset + index + 1
            with layout_independent_init(config, stream_offset=layer_number):
                self.layers.append(self._build_layer(symbol, layer_number))
        if post_process and post_layer_norm:
            self.final_norm = WrappedTorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        else:
            self.final_norm = None

    def _build_layer(self, symbol: str, layer_number: int) -> torch.nn.Module:
        common = dict(
            config=self.config,
            layer_number=layer_number,
            pg_collection=self.pg_collection,
            pp_layer_offset=self.pp_layer_offset,
        )
        if symbol == Symbols.MAMBA:
            return build_module(self.submodules.mamba_layer, **common)
        # TransformerLayers add the transformer pipeline split's offset unless told not to; the number is global.
        spec = {
            Symbols.ATTENTION: self.submodules.attention_layer,
            Symbols.MLP: self.submodules.mlp_layer,
            Symbols.MOE: self.submodules.moe_layer,
        }[symbol]
        return build_module(spec, add_layer_offset=False, **common)

    def mamba_state_shapes_per_request(self) -> Optional[Tuple[Tuple[int], Tuple[int]]]:
        """(conv state shape, SSM state shape) of one sequence in a Mamba layer of this stage; None without one."""
        for layer in self.layers:
            if hasattr(layer, "mamba_state_shapes_per_request"):
                return layer.mamba_state_shapes_per_request()
        return None

    def set_input_tensor(self, input_tensor: torch.Tensor):
        """The activation received from the previous pipeline stage replaces ``hidden_states`` in forward."""
        self.input_tensor = input_tensor

    def forward(
        self,
        hidden_states: Union[torch.Tensor, WrappedTensor],
        attention_mask: torch.Tensor,
        inference_context: Optional[Any] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        *,
        inference_params: Optional[Any] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        padding_mask=None,
    ):
        """This stage's layers over ``hidden_states`` ``[s, b, h]``, then the final norm on the last stage."""
        if not self.pre_process:
            hidden_states = self.input_tensor
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        if hidden_states is None:
            raise ValueError(
                "HybridStack got no hidden_states: a stage without pre_process needs set_input_tensor() first"
            )
        inference_context = inference_context if inference_context is not None else inference_params
        # Under sequence parallelism every rank holds a different slice of the sequence, so dropout outside the
        # tensor-parallel regions draws from the per-rank stream (as in TransformerBlock).
        rng_context = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng_context:
            for symbol, layer in zip(self.layer_type_list, self.layers):
                with fp8_layer_context(self.config, layer.layer_number - 1):
                    if symbol == Symbols.MAMBA:
                        hidden_states = layer(
                            hidden_states,
                            attention_mask=attention_mask,
                            inference_context=inference_context,
                            packed_seq_params=packed_seq_params,
                        )
                    else:
                        hidden_states, _ = layer(
                            hidden_states,
                            attention_mask=attention_mask,
                            rotary_pos_emb=rotary_pos_emb,
                            inference_context=inference_context,
                            packed_seq_params=packed_seq_params,
                            padding_mask=padding_mask,
                        )
        if self.final_norm is not None:
            hidden_states = self.final_norm(hidden_states)
        return hidden_states

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: Optional[tuple] = None, metadata: Optional[dict] = None
    ) -> Dict[str, Any]:
        """Each layer under its own global index, ``layers.<n>.`` (no stacked layer axis, unlike TransformerBlock),
        and the final norm as ``final_norm.``."""
        if sharded_offsets:
            raise ValueError(
                f"HybridStack.sharded_state_dict got sharded_offsets={sharded_offsets!r}; its layers are stored "
                "one key each and take no offsets"
            )
        sharded_state_dict = {}
        for local_index, layer in enumerate(self.layers):
            local_prefix = f"{prefix}layers.{local_index}."
            layer_state = layer.sharded_state_dict(prefix=local_prefix, sharded_offsets=(), metadata=metadata)
            replace_prefix_for_sharding(layer_state, local_prefix, f"{prefix}layers.{layer.layer_number - 1}.")
            sharded_state_dict.update(layer_state)
        if self.final_norm is not None:
            sharded_state_dict.update(sharded_state_dict_default(self.final_norm, f"{prefix}final_norm.", (), metadata))
        return sharded_state_dict


# Megatron-Core keeps the stack's earlier names.
MambaStack = HybridStack
MambaStackSubmodules = HybridStackSubmodules
