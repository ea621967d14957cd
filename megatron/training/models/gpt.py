"""``GPTModelConfig`` (a TransformerConfig plus the GPT model's own settings) and ``GPTModelBuilder``, which builds
``megatron.core.models.gpt.GPTModel`` stages from it and wraps them for training (``dist_utils``)."""

import inspect
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_inference_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import get_gpt_heterogeneous_layer_spec
from megatron.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.heterogeneous.heterogeneous_config import HeterogeneousTransformerConfig
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models.base import (
    ModelBuilder,
    ModelConfig,
    ModelConfigError,
    TransformerProxyMixin,
    not_supported,
)
from megatron.training.models.dist_utils import build_with_wrap_hooks
from megatron.training.vocab_utils import calculate_padded_vocab_size


def get_gpt_modelopt_spec(
    config=None, local_core_attention=False, remap_te_layernorm=False, real_quant_cfg="None", **kwargs
) -> ModuleSpec:
    """Megatron's ModelOpt layer spec (``megatron.core.post_training``), which megatron-lite does not build."""
    raise not_supported("ModelOpt quantization layer specs", "restore_modelopt_state=True")


def get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=None) -> ModuleSpec:
    """Megatron's block spec for experimental attention variants, which megatron-lite does not build."""
    raise not_supported(
        "experimental attention variants", f"experimental_attention_variant={config.experimental_attention_variant!r}"
    )


def default_layer_spec(config: "GPTModelConfig", vp_stage: int) -> ModuleSpec:
    """The layer (or block) spec a GPTModelConfig without ``transformer_layer_spec`` gets, chosen in Megatron's
    order: inference-optimized, ModelOpt, experimental attention, MoE, heterogeneous, then Transformer Engine or
    local layers by ``transformer_impl``."""
    transformer = config.transformer
    use_te = transformer.transformer_impl == "transformer_engine"
    if transformer.transformer_impl == "inference_optimized":
        return get_gpt_layer_with_inference_spec(
            transformer.qk_layernorm, transformer.multi_latent_attention, qk_l2_norm=transformer.qk_l2_norm
        )
    if config.restore_modelopt_state:
        from megatron.core import parallel_state

        # An arbitrary attention mask (speculative decoding) is only possible without context parallelism.
        arbitrary_mask = config.use_arbitrary_attention_mask
        if arbitrary_mask is None:
            arbitrary_mask = parallel_state.get_context_parallel_world_size() == 1
        return get_gpt_modelopt_spec(
            config=transformer,
            local_core_attention=False,
            remap_te_layernorm=True,
            real_quant_cfg="None",
            use_arbitrary_attention_mask=arbitrary_mask,
        )
    if transformer.experimental_attention_variant is not None:
        return get_transformer_block_with_experimental_attention_variant_spec(config=transformer, vp_stage=vp_stage)
    if transformer.num_moe_experts is not None:
        return get_gpt_decoder_block_spec(
            transformer,
            use_transformer_engine=use_te,
            normalization=transformer.normalization,
            qk_l2_norm=transformer.qk_l2_norm,
            vp_stage=vp_stage,
        )
    if isinstance(transformer, HeterogeneousTransformerConfig):
        return get_gpt_heterogeneous_layer_spec(transformer, use_te)
    return _te_or_local_layer_spec(config, vp_stage)


def _te_or_local_layer_spec(config: "GPTModelConfig", vp_stage: int) -> ModuleSpec:
    """The dense layer spec: Transformer Engine's layout or megatron-core's local modules."""
    transformer = config.transformer
    if transformer.transformer_impl == "transformer_engine":
        extra = {}
        if "use_te_op_fuser" in inspect.signature(get_gpt_layer_with_transformer_engine_spec).parameters:
            extra["use_te_op_fuser"] = config.use_transformer_engine_op_fuser
        return get_gpt_layer_with_transformer_engine_spec(
            transformer.num_moe_experts,
            transformer.moe_grouped_gemm,
            transformer.qk_layernorm,
            transformer.multi_latent_attention,
            qk_l2_norm=transformer.qk_l2_norm,
            use_kitchen=transformer.use_kitchen,
            use_te_activation_func=transformer.use_te_activation_func,
            use_kitchen_attention=transformer.use_kitchen_attention,
            kitchen_attention_backend=transformer.kitchen_attention_backend,
            mla_down_proj_fusion=getattr(transformer, "mla_down_proj_fusion", False),
            use_grouped_gemm_for_dense_mlp=getattr(transformer, "use_grouped_gemm_for_dense_mlp", False),
            **extra,
        )
    return get_gpt_layer_local_spec(
        transformer.num_moe_experts,
        transformer.moe_grouped_gemm,
        transformer.qk_layernorm,
        transformer.multi_latent_attention,
        # The fifth parameter (fp8) gets the attention variant, as in Megatron-LM; it is None on this path.
        transformer.experimental_attention_variant,
        normalization=transformer.normalization,
        use_kitchen=transformer.use_kitchen,
        use_kitchen_attention=transformer.use_kitchen_attention,
        kitchen_attention_backend=transformer.kitchen_attention_backend,
    )


@dataclass(kw_only=True)
class GPTModelConfig(TransformerProxyMixin, ModelConfig):
    """A GPT model: its ``transformer`` config and the model's own settings. Names it does not have are read from
    and written to ``transformer`` (``config.hidden_size``). ``vocab_size`` is the tokenizer's; with
    ``should_pad_vocab`` the builder pads it for tensor parallelism (``make_vocab_size_divisible_by``)."""

    builder: ClassVar[str] = "megatron.training.models.gpt.GPTModelBuilder"
    transformer: TransformerConfig
    transformer_layer_spec: ModuleSpec | Callable[["GPTModelConfig"], ModuleSpec] | None = None
    vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    should_pad_vocab: bool = False
    seq_length: int = 1024
    fp16_lm_cross_entropy: bool = False
    parallel_output: bool = True
    share_embeddings_and_output_weights: bool = False
    position_embedding_type: Literal["learned_absolute", "rope", "mrope", "yarn", "none"] = "learned_absolute"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    scatter_embedding_sequence_parallel: bool = True
    seq_len_interpolation_factor: float | None = None
    tp_comm_overlap_cfg: str | dict[str, Any] | None = None
    use_arbitrary_attention_mask: bool | None = None

    def finalize(self) -> None:
        """Checks to run once the config is complete: the transformer's own ``finalize`` if it has one, the RNG
        tracker CUDA graphs need, and equal model chunks on every pipeline stage with virtual pipelining."""
        finalize_transformer(self.transformer)
        transformer = self.transformer
        vp_size = transformer.virtual_pipeline_model_parallel_size
        flexible_layout = (
            transformer.account_for_embedding_in_pipeline_split
            or transformer.account_for_loss_in_pipeline_split
            or transformer.num_layers_in_first_pipeline_stage is not None
            or transformer.num_layers_in_last_pipeline_stage is not None
            or transformer.pipeline_model_parallel_layout is not None
        )
        if vp_size and not flexible_layout:
            per_stage = transformer.num_layers // transformer.pipeline_model_parallel_size
            if per_stage % vp_size:
                raise ModelConfigError(
                    f"Make sure the number of model chunks is the same across all pipeline stages: {per_stage} "
                    f"layers per pipeline stage (num_layers={transformer.num_layers} / pipeline_model_parallel_size="
                    f"{transformer.pipeline_model_parallel_size}) do not split into virtual_pipeline_model_parallel_"
                    f"size={vp_size} chunks; change num_layers or the virtual pipeline size"
                )


def finalize_transformer(transformer) -> None:
    """The checks both model configs share: the transformer's ``finalize`` and the CUDA-graph RNG tracker."""
    if callable(getattr(transformer, "finalize", None)):
        transformer.finalize()
    if transformer.cuda_graph_impl != "none" and not transformer.use_te_rng_tracker:
        raise ModelConfigError(
            f"Transformer Engine's RNG tracker is required for CUDA graphs (cuda_graph_impl="
            f"{transformer.cuda_graph_impl!r}); set use_te_rng_tracker=True (--te-rng-tracker)"
        )


def _layer_spec(config: GPTModelConfig, vp_stage):
    spec = config.transformer_layer_spec
    if spec is None:
        return default_layer_spec(config, vp_stage)
    if not isinstance(spec, ModuleSpec) and callable(spec):
        if "vp_stage" in inspect.signature(spec).parameters:
            return spec(config, vp_stage=vp_stage)
        return spec(config)
    return spec


class GPTModelBuilder(ModelBuilder[GPTModel, GPTModelConfig]):
    """Builds ``GPTModel`` stages from a ``GPTModelConfig``: one (``build_model``) or this rank's stages wrapped for
    training (``build_distributed_models``)."""

    def build_model(
        self,
        pg_collection: ProcessGroupCollection,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        vp_stage: int | None = None,
    ) -> GPTModel:
        """One GPTModel stage. The layer spec is the config's (a spec, or a function of the config and optionally
        ``vp_stage``) or ``default_layer_spec``; ``pre_process``/``post_process`` default to the stage's place in
        the virtual and real pipeline."""
        config = self._model_config
        layer_spec = _layer_spec(config, vp_stage)
        vocab_size = config._padded_vocab_size(calculate_padded_vocab_size)
        mtp_spec = mtp_block_spec(config, layer_spec, vp_stage=vp_stage)
        if config.attention_backend == AttnBackend.local and hasattr(layer_spec, "submodules"):
            layer_spec.submodules.self_attention.submodules.core_attention = DotProductAttention
        vp_size = config.virtual_pipeline_model_parallel_size
        if pre_process is None:
            pre_process = is_vp_first_stage(vp_stage=vp_stage, vp_size=vp_size) and is_pp_first_stage(pg_collection.pp)
        if post_process is None:
            post_process = is_vp_last_stage(vp_stage=vp_stage, vp_size=vp_size) and is_pp_last_stage(pg_collection.pp)
        return GPTModel(
            config=config.transformer,
            transformer_layer_spec=layer_spec,
            mtp_block_spec=mtp_spec,
            vocab_size=vocab_size,
            max_sequence_length=config.seq_length,
            fp16_lm_cross_entropy=config.fp16_lm_cross_entropy,
            parallel_output=config.parallel_output,
            share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
            position_embedding_type=config.position_embedding_type,
            rotary_percent=config.rotary_percent,
            rotary_base=config.rotary_base,
            rope_scaling=config.rope_scaling,
            rope_scaling_factor=config.rope_scaling_factor,
            seq_len_interpolation_factor=config.seq_len_interpolation_factor,
            scatter_embedding_sequence_parallel=config.scatter_embedding_sequence_parallel,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )

    def build_distributed_models(
        self,
        pg_collection: ProcessGroupCollection,
        ddp_config: DistributedDataParallelConfig | None = None,
        overlap_param_gather_with_optimizer_step: bool = False,
        use_megatron_fsdp: bool = False,
        use_torch_fsdp2: bool = False,
        wrap_with_ddp: bool = True,
        data_parallel_random_init: bool = True,
        mixed_precision_wrapper: Callable[[Any, MegatronModule], MegatronModule] | None = Float16Module,
        model_type: ModelType = ModelType.encoder_or_decoder,
    ) -> list[GPTModel]:
        """This rank's stages through the pre-wrap hooks, prepared and wrapped (``unimodal_build_distributed_
        models``), then through the post-wrap hooks."""
        return build_with_wrap_hooks(
            self,
            pg_collection,
            ddp_config=ddp_config,
            overlap_param_gather_with_optimizer_step=overlap_param_gather_with_optimizer_step,
            use_megatron_fsdp=use_megatron_fsdp,
            use_torch_fsdp2=use_torch_fsdp2,
            wrap_with_ddp=wrap_with_ddp,
            data_parallel_random_init=data_parallel_random_init,
            mixed_precision_wrapper=mixed_precision_wrapper,
            model_type=model_type,
        )


def mtp_block_spec(config: GPTModelConfig, transformer_layer_spec: ModuleSpec, vp_stage: int | None = None):
    """The multi-token-prediction block spec when ``mtp_num_layers`` is set (built on the last decoder layer's
    spec), else None."""
    transformer = config.transformer
    if transformer.mtp_num_layers is None:
        return None
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = transformer.transformer_impl == "transformer_engine"
    if hasattr(transformer_layer_spec, "layer_specs") and len(transformer_layer_spec.layer_specs) == 0:
        # A block spec with no decoder layer on this (last) stage: take the dense layer spec instead.
        spec = _te_or_local_layer_spec(config, vp_stage)
    else:
        spec = get_gpt_decoder_layer_specs(
            transformer,
            use_transformer_engine=use_te,
            normalization=transformer.normalization,
            qk_l2_norm=transformer.qk_l2_norm,
            vp_stage=vp_stage,
        )[-1]
    return gpt_layer_specs.get_gpt_mtp_block_spec(transformer, spec, use_transformer_engine=use_te, vp_stage=vp_stage)
