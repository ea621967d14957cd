"""A stack of transformer layers (this pipeline stage's share of them) plus the final norm on the last stage."""

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.fp8.context import fp8_layer_context
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.activation_offload import install_fine_grained_offloading, layer_offload_context
from megatron.core.transformer.config_validation import require_model_sizes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (  # noqa: F401  (the split's home; imported from here too)
    TransformerLayer,
    _layers_per_virtual_stage,
    _pp_rank,
    _virtual_stage_index,
    get_transformer_layer_offset,
    layers_per_virtual_stage,
)
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import WrappedTensor, layout_independent_init


@dataclass
class TransformerBlockSubmodules:
    layer_specs: List[ModuleSpec] = None
    layer_norm: Optional[Union[ModuleSpec, type]] = None


def get_num_layers_to_build(
    config: TransformerConfig, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> int:
    """Number of transformer layers pipeline rank ``pp_rank`` (this rank when None) builds for model chunk
    ``vp_stage`` (None without virtual stages)."""
    return _layers_per_virtual_stage(config)[_virtual_stage_index(config, vp_stage, pp_rank)]


def _block_submodules(config: TransformerConfig, spec) -> TransformerBlockSubmodules:
    if isinstance(spec, TransformerBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type):
        if issubclass(spec.module, TransformerBlock):
            return spec.submodules
        if issubclass(spec.module, TransformerLayer):
            # A layer spec may name the final norm that matches its own norms (e.g. Transformer Engine's layout).
            final_norm = spec.metainfo.get("final_layernorm", WrappedTorchNorm)
            return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=final_norm)
    raise TypeError(f"cannot build a TransformerBlock from {type(spec).__name__} {spec!r}")


class TransformerBlock(MegatronModule):
    """This stage's transformer layers; ``[s, b, h]`` in and out.

    On a stage without ``pre_process`` the input comes from :meth:`set_input_tensor` (the pipeline schedule hands
    it the previous stage's output); with ``post_process`` the final norm is applied.
    """

    def __init__(
        self,
        config: TransformerConfig,
        spec: Union[TransformerBlockSubmodules, ModuleSpec],
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: Optional[ProcessGroupCollection] = None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(config)
        require_model_sizes(config, "TransformerBlock")
        self.submodules = _block_submodules(config, spec)
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.vp_stage = vp_stage
        self.input_tensor = None

        pp_rank = _pp_rank(pg_collection, config)
        num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        layer_specs = self.submodules.layer_specs
        if len(layer_specs) == config.num_layers:
            layer_specs = layer_specs[offset : offset + num_layers]
        elif len(layer_specs) != num_layers:
            raise ValueError(
                f"the block spec lists {len(layer_specs)} layers but this stage builds {num_layers} "
                f"(of num_layers={config.num_layers})"
            )
        self.layers = torch.nn.ModuleList()
        for i, layer_spec in enumerate(layer_specs):
            # Layers are numbered within the stage; each adds the stage's offset itself (Megatron's convention),
            # while the init stream is keyed by the global number so weights do not depend on the layout.
            with layout_independent_init(config, stream_offset=offset + i + 1):
                self.layers.append(
                    build_module(
                        layer_spec,
                        config=config,
                        layer_number=i + 1,
                        pg_collection=pg_collection,
                        vp_stage=vp_stage,
                    )
                )
        if config.fine_grained_activation_offloading:
            for layer in self.layers:
                install_fine_grained_offloading(layer, config)
        if self.has_final_layernorm_in_this_stage():
            self.final_layernorm = build_module(
                self.submodules.layer_norm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )
        else:
            self.final_layernorm = None

    def has_final_layernorm_in_this_stage(self):
        """Whether this stage applies the final norm: the last stage, when the block has one."""
        return self.post_process and self.post_layer_norm and self.submodules.layer_norm is not None

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """The activation received from the previous pipeline stage replaces ``hidden_states`` in forward."""
        self.input_tensor = input_tensor

    def _checkpointed_forward(self, hidden_states, layer_kwargs):
        """Full recompute: ``recompute_method`` 'uniform' checkpoints chunks of ``recompute_num_layers`` layers;
        'block' checkpoints the first ``recompute_num_layers`` layers of the stage, one at a time."""
        tensor_names = ("attention_mask", "context", "context_mask", "rotary_pos_emb", "attention_bias")
        other_kwargs = {key: value for key, value in layer_kwargs.items() if key not in tensor_names}

        def run_layers(start: int, end: int):
            def custom_forward(hidden, *tensors):
                kwargs = dict(zip(tensor_names, tensors), **other_kwargs)
                for layer in self.layers[start:end]:
                    with fp8_layer_context(self.config, layer.layer_number - 1):
                        hidden, _ = layer(hidden, **kwargs)
                return hidden

            return custom_forward

        config = self.config
        tensors = [layer_kwargs[name] for name in tensor_names]
        num_layers = len(self.layers)
        chunk = config.recompute_num_layers
        start = 0
        while start < num_layers:
            if config.recompute_method == "uniform":
                end = min(start + chunk, num_layers)
                checkpointed = True
            else:  # block: the first recompute_num_layers layers of the stage, one at a time
                end = start + 1
                checkpointed = start < chunk
            if checkpointed:
                hidden_states = tensor_parallel.checkpoint(
                    run_layers(start, end), config.distribute_saved_activations, hidden_states, *tensors
                )
            else:
                hidden_states = run_layers(start, end)(hidden_states, *tensors)
            start = end
        return hidden_states

    def _extract(self, local_index: int, hidden_states, extract_layer_indices, intermediate) -> None:
        if extract_layer_indices and self.layers[local_index].layer_number - 1 in extract_layer_indices:
            intermediate.append(hidden_states)

    def forward(
        self,
        hidden_states: Union[torch.Tensor, WrappedTensor],
        attention_mask: Optional[torch.Tensor],
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        rotary_pos_cos: Optional[torch.Tensor] = None,
        rotary_pos_sin: Optional[torch.Tensor] = None,
        rotary_pos_cos_sin: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        sequence_len_offset: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        extract_layer_indices: Optional[Set[int]] = None,
        *,
        inference_params: Optional[Any] = None,
        dynamic_inference_decode_only: Optional[bool] = None,
    ):
        """This stage's layers over ``hidden_states`` ``[s, b, h]`` (a WrappedTensor is unwrapped, so the caller's
        reference can be dropped early).

        With ``extract_layer_indices`` (global, 0-based layer indices) returns ``(hidden_states, intermediate)``:
        the outputs of those of this stage's layers, in layer order. With an ``inference_context`` the
        attention layers read and write its KV cache. ``dynamic_inference_decode_only`` is Megatron's hint for
        CUDA-graph selection in its dynamic engine; this block runs the same either way.
        """
        if not self.pre_process:
            hidden_states = self.input_tensor
        if isinstance(hidden_states, WrappedTensor):
            hidden_states = hidden_states.unwrap()
        if hidden_states is None:
            raise ValueError(
                "TransformerBlock got no hidden_states: a stage without pre_process needs set_input_tensor() first"
            )
        layer_kwargs = dict(
            attention_mask=attention_mask,
            context=context,
            context_mask=context_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            inference_context=inference_context if inference_context is not None else inference_params,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            padding_mask=padding_mask,
        )
        intermediate = []
        # Under sequence parallelism every rank holds a different slice of the sequence, so dropout in the
        # non-tensor-parallel regions must draw from the per-rank stream.
        rng_context = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng_context:
            if self.config.recompute_granularity == "full" and self.training:
                if extract_layer_indices:
                    # Recomputed layers run again in backward; their outputs are not kept to hand back.
                    raise ValueError("not supported yet: extract_layer_indices with recompute_granularity='full'")
                hidden_states = self._checkpointed_forward(hidden_states, layer_kwargs)
            else:
                for index, layer in enumerate(self.layers):
                    with layer_offload_context(self.config, index, self.training) or nullcontext():
                        with fp8_layer_context(self.config, layer.layer_number - 1):
                            hidden_states, context = layer(hidden_states, **layer_kwargs)
                    layer_kwargs["context"] = context
                    self._extract(index, hidden_states, extract_layer_indices, intermediate)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        if extract_layer_indices is not None:
            return hidden_states, intermediate
        return hidden_states

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict = None
    ) -> Dict[str, Any]:
        """Every layer's tensors stacked under one key with a leading layer axis, indexed by the global layer number.

        Local layer ``i`` of this stage is global layer ``layer_number - 1``, so
        ``decoder.layers.self_attention.linear_qkv.weight`` has shape ``[num_layers, ...]`` whatever the pipeline
        layout that wrote or reads it. Layers that differ from each other (``moe_layer_freq`` other than 1, which
        mixes dense and MoE layers, ``heterogeneous_block_specs``, or ``metadata["non_homogeneous_layers"]``) are
        stored one key per layer instead, ``decoder.layers.<global index>.…``, as Megatron-Core does.
        """
        if sharded_offsets:
            raise ValueError(
                f"TransformerBlock.sharded_state_dict got sharded_offsets={sharded_offsets!r}; the block adds the "
                "layer axis itself and must be called without offsets"
            )
        sharded_state_dict = {}
        layers_prefix = f"{prefix}layers."
        per_layer_keys = _non_homogeneous_layers(self.config, metadata)
        for local_index, layer in enumerate(self.layers):
            global_index = layer.layer_number - 1
            local_prefix = f"{layers_prefix}{local_index}."
            if per_layer_keys:
                sharded_prefix, layer_axis = f"{layers_prefix}{global_index}.", ()
            else:
                sharded_prefix, layer_axis = layers_prefix, ((0, global_index, self.config.num_layers),)
            layer_state = layer.sharded_state_dict(prefix=local_prefix, sharded_offsets=layer_axis, metadata=metadata)
            replace_prefix_for_sharding(layer_state, local_prefix, sharded_prefix)
            sharded_state_dict.update(layer_state)
        for name, module in self.named_children():
            if module is not self.layers:
                sharded_state_dict.update(
                    sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata)
                )
        return sharded_state_dict


def _non_homogeneous_layers(config, metadata) -> bool:
    """Whether the block's layers differ in structure, so that their tensors cannot share one stacked key."""
    moe_layer_freq = config.moe_layer_freq
    return bool(
        (metadata or {}).get("non_homogeneous_layers", False)
        or isinstance(moe_layer_freq, list)
        or (isinstance(moe_layer_freq, int) and moe_layer_freq > 1)
        or getattr(config, "heterogeneous_block_specs", False)
    )
