"""A stack of transformer layers (this pipeline stage's share of them) plus the final norm on the last stage."""

from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import layout_independent_init


@dataclass
class TransformerBlockSubmodules:
    layer_specs: List[ModuleSpec] = None
    layer_norm: Optional[Union[ModuleSpec, type]] = None


def layers_per_virtual_stage(
    num_layers: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    num_layers_in_first_pipeline_stage: Optional[int] = None,
    num_layers_in_last_pipeline_stage: Optional[int] = None,
    account_for_embedding_in_pipeline_split: bool = False,
    account_for_loss_in_pipeline_split: bool = False,
) -> List[int]:
    """Layers built by each virtual stage, in pipeline order (virtual stage ``c * pp + r``: chunk ``c`` of rank ``r``).

    The one definition of the pipeline layer split (``validate_args`` and the layout report use it too); the
    arguments are the :class:`TransformerConfig` fields of the same names. Without virtual stages there is one per
    pipeline rank. Layers are split evenly, except that ``num_layers_in_first/last_pipeline_stage`` fix the
    first/last rank's share (the rest split evenly over the other ranks), and
    ``account_for_embedding/loss_in_pipeline_split`` count the embedding / the loss as one more layer of the first /
    last virtual stage. Each rank's share splits evenly into its virtual stages. A bad split raises a ``ValueError``
    naming the fields.
    """
    pp = pipeline_model_parallel_size
    for name, value in (("num_layers", num_layers), ("pipeline_model_parallel_size", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    vp = virtual_pipeline_model_parallel_size or 1
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    extra_first = int(account_for_embedding_in_pipeline_split)
    extra_last = int(account_for_loss_in_pipeline_split)
    if first is not None or last is not None:
        if extra_first or extra_last:
            raise ValueError(
                "num_layers_in_first/last_pipeline_stage cannot be combined with account_for_embedding_in_pipeline_"
                "split or account_for_loss_in_pipeline_split; use one way of balancing the stages"
            )
        per_rank = _uneven_layers_per_rank(num_layers, pp, first, last)
    else:
        slots = num_layers + extra_first + extra_last
        if slots % pp != 0:
            counted = f"num_layers ({num_layers})"
            if extra_first or extra_last:
                counted += f" + embedding/loss ({extra_first + extra_last}) = {slots}"
            raise ValueError(
                f"{counted} is not divisible by pipeline_model_parallel_size ({pp}); change num_layers or "
                "pipeline_model_parallel_size, or set num_layers_in_first/last_pipeline_stage for an uneven split"
            )
        per_rank = [slots // pp] * pp
    for rank, count in enumerate(per_rank):
        if count % vp != 0:
            raise ValueError(
                f"pipeline stage {rank} has {count} layers, not divisible by virtual_pipeline_model_parallel_size "
                f"({vp}); change num_layers, the stage sizes or virtual_pipeline_model_parallel_size so that every "
                "stage's layers split evenly into its model chunks"
            )
    per_virtual = [per_rank[rank] // vp for _ in range(vp) for rank in range(pp)]
    # Each virtual stage has at least one slot, and the first and last differ unless there is only one (which then
    # has num_layers + both extras), so no count goes negative.
    per_virtual[0] -= extra_first
    per_virtual[-1] -= extra_last
    return per_virtual


def _uneven_layers_per_rank(num_layers: int, pp: int, first: Optional[int], last: Optional[int]) -> List[int]:
    if pp == 1:
        raise ValueError(
            "num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1; unset them for one stage"
        )
    for name, value in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        raise ValueError(
            f"num_layers ({num_layers}) does not match num_layers_in_first_pipeline_stage ({first}) + "
            f"num_layers_in_last_pipeline_stage ({last}) on {pp} pipeline stages; make them add up to at most "
            "num_layers (exactly num_layers when they are the only stages)"
        )
    if middle_stages and middle_layers % middle_stages != 0:
        raise ValueError(
            f"the {middle_layers} layers left after num_layers_in_first/last_pipeline_stage do not divide evenly "
            f"over the other {middle_stages} pipeline stages; adjust num_layers, the first/last stage sizes or "
            "pipeline_model_parallel_size"
        )
    per_rank = [middle_layers // middle_stages if middle_stages else 0] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    return per_rank


def _layers_per_virtual_stage(config: TransformerConfig) -> List[int]:
    """:func:`layers_per_virtual_stage` for ``config``'s fields."""
    return layers_per_virtual_stage(
        config.num_layers,
        config.pipeline_model_parallel_size,
        config.virtual_pipeline_model_parallel_size,
        config.num_layers_in_first_pipeline_stage,
        config.num_layers_in_last_pipeline_stage,
        config.account_for_embedding_in_pipeline_split,
        config.account_for_loss_in_pipeline_split,
    )


def _virtual_stage_index(config: TransformerConfig, vp_stage: Optional[int]) -> int:
    """Position of this rank's chunk ``vp_stage`` among all virtual stages."""
    pp = config.pipeline_model_parallel_size
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
    vp = config.virtual_pipeline_model_parallel_size
    if vp is None:
        return pp_rank
    if vp_stage is None or not 0 <= vp_stage < vp:
        raise ValueError(
            f"virtual_pipeline_model_parallel_size={vp} needs the model chunk's vp_stage (0 .. {vp - 1}), "
            f"got {vp_stage!r}; build one model per chunk with vp_stage=chunk"
        )
    return vp_stage * pp + pp_rank


def get_num_layers_to_build(config: TransformerConfig, vp_stage: Optional[int] = None) -> int:
    """Number of transformer layers this rank builds for model chunk ``vp_stage`` (None without virtual stages)."""
    return _layers_per_virtual_stage(config)[_virtual_stage_index(config, vp_stage)]


def get_transformer_layer_offset(config: TransformerConfig, vp_stage: Optional[int] = None) -> int:
    """Global index of the first layer this rank builds for model chunk ``vp_stage``.

    Virtual stages take consecutive slices of the model in pipeline order: chunk ``c`` of rank ``r`` of ``p``
    comes after every chunk ``< c`` of every rank and after chunk ``c`` of ranks ``< r``.
    """
    counts = _layers_per_virtual_stage(config)
    return sum(counts[: _virtual_stage_index(config, vp_stage)])


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
        self.layers = torch.nn.ModuleList()
        for i, layer_spec in enumerate(layer_specs):
            layer_number = offset + i + 1
            with layout_independent_init(config, stream_offset=layer_number):
                self.layers.append(
                    build_module(
                        layer_spec,
                        config=config,
                        layer_number=layer_number,
                        pg_collection=pg_collection,
                        vp_stage=vp_stage,
                    )
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

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Every layer's tensors stacked under one key with a leading layer axis, indexed by the global layer number.

        Local layer ``i`` of this stage is global layer ``layer_number - 1``, so
        ``decoder.layers.self_attention.linear_qkv.weight`` has shape ``[num_layers, ...]`` whatever the pipeline
        layout that wrote or reads it.
        """
        if sharded_offsets:
            raise ValueError(
                f"TransformerBlock.sharded_state_dict got sharded_offsets={sharded_offsets!r}; the block adds the "
                "layer axis itself and must be called without offsets"
            )
        sharded_state_dict = {}
        layers_prefix = f"{prefix}layers."
        for local_index, layer in enumerate(self.layers):
            global_index = layer.layer_number - 1
            local_prefix = f"{layers_prefix}{local_index}."
            layer_axis = ((0, global_index, self.config.num_layers),)
            layer_state = layer.sharded_state_dict(prefix=local_prefix, sharded_offsets=layer_axis, metadata=metadata)
            replace_prefix_for_sharding(layer_state, local_prefix, layers_prefix)
            sharded_state_dict.update(layer_state)
        for name, module in self.named_children():
            if module is not self.layers:
                sharded_state_dict.update(
                    sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata)
                )
        return sharded_state_dict
