"""A stack of transformer layers (this pipeline stage's share of them) plus the final norm on the last stage."""

from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


@dataclass
class TransformerBlockSubmodules:
    layer_specs: List[ModuleSpec] = None
    layer_norm: Optional[Union[ModuleSpec, type]] = None


def _pipeline_layout(config: TransformerConfig, vp_stage: Optional[int]):
    """(pipeline rank, pipeline size, virtual stage, virtual size) for the stage being built."""
    pp_size = config.pipeline_model_parallel_size
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp_size > 1 else 0
    vp_size = config.virtual_pipeline_model_parallel_size or 1
    if vp_stage is None:
        vp_stage = 0
    return pp_rank, pp_size, vp_stage, vp_size


def _layers_per_stage(config: TransformerConfig) -> List[int]:
    """Layers on each pipeline stage (before virtual splitting), honouring uneven first/last stages."""
    pp_size = config.pipeline_model_parallel_size
    first, last = config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage
    if pp_size == 1:
        return [config.num_layers]
    middle_stages = pp_size - (first is not None) - (last is not None)
    middle_layers = config.num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        raise ValueError(
            f"num_layers ({config.num_layers}) does not match num_layers_in_first_pipeline_stage ({first}) + "
            f"num_layers_in_last_pipeline_stage ({last}) over {pp_size} pipeline stages"
        )
    if middle_stages and middle_layers % middle_stages != 0:
        raise ValueError(
            f"the {middle_layers} layers left for the {middle_stages} middle pipeline stages do not divide evenly; "
            "adjust num_layers, num_layers_in_first/last_pipeline_stage or pipeline_model_parallel_size"
        )
    per_middle = middle_layers // middle_stages if middle_stages else 0
    counts = [per_middle] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def get_num_layers_to_build(config: TransformerConfig, vp_stage: Optional[int] = None) -> int:
    """Number of layers the (virtual) pipeline stage ``vp_stage`` of this rank builds."""
    pp_rank, _, _, vp_size = _pipeline_layout(config, vp_stage)
    stage_layers = _layers_per_stage(config)[pp_rank]
    if stage_layers % vp_size != 0:
        raise ValueError(
            f"pipeline stage {pp_rank} has {stage_layers} layers, not divisible into "
            f"virtual_pipeline_model_parallel_size={vp_size} chunks"
        )
    return stage_layers // vp_size


def get_transformer_layer_offset(config: TransformerConfig, vp_stage: Optional[int] = None) -> int:
    """Global index of this (virtual) stage's first layer.

    With virtual stages the model is cut into ``pp * vp`` chunks taken round-robin: chunk ``v`` of pipeline rank
    ``p`` is global chunk ``v * pp + p``.
    """
    pp_rank, pp_size, vp_stage, vp_size = _pipeline_layout(config, vp_stage)
    counts = _layers_per_stage(config)
    if vp_size == 1:
        return sum(counts[:pp_rank])
    chunk_sizes = [counts[p] // vp_size for p in range(pp_size)]
    # Every virtual round covers one chunk of each stage; within a round, stages come in pipeline order.
    return vp_stage * sum(chunk_sizes) + sum(chunk_sizes[:pp_rank])


def _block_submodules(config: TransformerConfig, spec) -> TransformerBlockSubmodules:
    if isinstance(spec, TransformerBlockSubmodules):
        return spec
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, type):
        if issubclass(spec.module, TransformerBlock):
            return spec.submodules
        if issubclass(spec.module, TransformerLayer):
            return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=WrappedTorchNorm)
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
        self.submodules = _block_submodules(config, spec)
        self.pre_process = pre_process
        self.post_process = post_process
        self.post_layer_norm = post_layer_norm
        self.vp_stage = vp_stage
        self.input_tensor = None

        num_layers = get_num_layers_to_build(config, vp_stage)
        offset = get_transformer_layer_offset(config, vp_stage)
        layer_specs = self.submodules.layer_specs
        if len(layer_specs) == config.num_layers:
            layer_specs = layer_specs[offset : offset + num_layers]
        elif len(layer_specs) != num_layers:
            raise ValueError(
                f"the block spec lists {len(layer_specs)} layers but this stage builds {num_layers} "
                f"(of num_layers={config.num_layers})"
            )
        self.layers = torch.nn.ModuleList(
            build_module(
                layer_spec,
                config=config,
                layer_number=offset + i + 1,
                pg_collection=pg_collection,
                vp_stage=vp_stage,
            )
            for i, layer_spec in enumerate(layer_specs)
        )
        if post_process and post_layer_norm and self.submodules.layer_norm is not None:
            self.final_layernorm = build_module(
                self.submodules.layer_norm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )
        else:
            self.final_layernorm = None

    def set_input_tensor(self, input_tensor: torch.Tensor) -> None:
        """The activation received from the previous pipeline stage replaces ``hidden_states`` in forward."""
        self.input_tensor = input_tensor

    def _checkpointed_forward(self, hidden_states, attention_mask, rotary_pos_emb, attention_bias):
        def run_layers(start: int, end: int):
            def custom_forward(hidden, mask, rotary, bias):
                for layer in self.layers[start:end]:
                    hidden, _ = layer(hidden, attention_mask=mask, rotary_pos_emb=rotary, attention_bias=bias)
                return hidden

            return custom_forward

        config = self.config
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
                    run_layers(start, end),
                    config.distribute_saved_activations,
                    hidden_states,
                    attention_mask,
                    rotary_pos_emb,
                    attention_bias,
                )
            else:
                hidden_states = run_layers(start, end)(hidden_states, attention_mask, rotary_pos_emb, attention_bias)
            start = end
        return hidden_states

    def forward(
        self,
        hidden_states: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        context: Optional[torch.Tensor] = None,
        context_mask: Optional[torch.Tensor] = None,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ) -> torch.Tensor:
        if not self.pre_process:
            hidden_states = self.input_tensor
        if hidden_states is None:
            raise ValueError(
                "TransformerBlock got no hidden_states: a stage without pre_process needs set_input_tensor() first"
            )
        # Under sequence parallelism every rank holds a different slice of the sequence, so dropout in the
        # non-tensor-parallel regions must draw from the per-rank stream.
        rng_context = tensor_parallel.get_cuda_rng_tracker().fork() if self.config.sequence_parallel else nullcontext()
        with rng_context:
            if self.config.recompute_granularity == "full" and self.training:
                hidden_states = self._checkpointed_forward(
                    hidden_states, attention_mask, rotary_pos_emb, attention_bias
                )
            else:
                for layer in self.layers:
                    hidden_states, context = layer(
                        hidden_states,
                        attention_mask=attention_mask,
                        context=context,
                        context_mask=context_mask,
                        rotary_pos_emb=rotary_pos_emb,
                        attention_bias=attention_bias,
                        inference_context=inference_context,
                        packed_seq_params=packed_seq_params,
                    )
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
