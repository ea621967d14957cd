"""``HybridModelConfig`` (a TransformerConfig plus the hybrid Mamba/attention model's own settings) and
``HybridModelBuilder``, which builds ``megatron.core.models.hybrid.HybridModel`` stages from it and wraps them for
training (``dist_utils``)."""

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.enums import ModelType
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as default_hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module, MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.models.base import (
    ModelBuilder,
    ModelConfig,
    TransformerProxyMixin,
    not_supported,
)
from megatron.training.models.dist_utils import build_with_wrap_hooks
from megatron.training.models.gpt import finalize_transformer
from megatron.training.vocab_utils import calculate_padded_vocab_size

# Megatron-Core's stack spec for transformer_impl="inference_optimized"; megatron-lite has none (None: refused).
hybrid_inference_stack_spec = None


def get_hybrid_stack_modelopt_spec(local_core_attention: bool = False, remap_te_layernorm: bool = False):
    """Megatron's ModelOpt hybrid stack spec (``megatron.core.post_training``), which megatron-lite does not build."""
    raise not_supported("ModelOpt quantization layer specs", "restore_modelopt_state=True")


@dataclass(kw_only=True)
class HybridModelConfig(TransformerProxyMixin, ModelConfig):
    """A hybrid (Mamba, attention, MLP, MoE layers) model: its ``transformer`` config and the model's own settings,
    the layer mix given by ``hybrid_layer_pattern`` (``hybrid_attention_ratio``, ``hybrid_mlp_ratio`` and
    ``hybrid_override_pattern`` are Megatron's deprecated alternatives). Names it does not have are read from and
    written to ``transformer``. ``vocab_size`` is the tokenizer's; ``should_pad_vocab`` pads it."""

    builder: ClassVar[str] = "megatron.training.models.hybrid.HybridModelBuilder"
    transformer: TransformerConfig
    fp16_lm_cross_entropy: bool = False
    parallel_output: bool = True
    share_embeddings_and_output_weights: bool = False
    hybrid_attention_ratio: float = 0.0
    hybrid_mlp_ratio: float = 0.0
    hybrid_override_pattern: str | None = None
    hybrid_layer_pattern: str | None = None
    seq_length: int = 8192
    # Without attention layers a hybrid model needs no position embedding.
    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "none"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    seq_len_interpolation_factor: float | None = None
    make_vocab_size_divisible_by: int = 128
    hybrid_stack_spec: ModuleSpec | None = None
    vocab_size: int | None = None
    should_pad_vocab: bool = False

    @property
    def mamba_stack_spec(self):
        """Megatron's older name of ``hybrid_stack_spec``."""
        return self.hybrid_stack_spec

    @mamba_stack_spec.setter
    def mamba_stack_spec(self, value):
        self.hybrid_stack_spec = value

    def finalize(self) -> None:
        """Checks to run once the config is complete (the transformer's own ``finalize`` if it has one)."""
        finalize_transformer(self.transformer)


class HybridModelBuilder(ModelBuilder[HybridModel, HybridModelConfig]):
    """Builds ``HybridModel`` stages from a ``HybridModelConfig`` (no virtual pipelining, as in Megatron)."""

    def _stack_spec(self) -> ModuleSpec:
        config = self._model_config
        if config.hybrid_stack_spec is not None:
            return config.hybrid_stack_spec
        if config.transformer.transformer_impl == "inference_optimized":
            if hybrid_inference_stack_spec is None:
                raise not_supported("inference-optimized hybrid layers", "transformer_impl='inference_optimized'")
            return hybrid_inference_stack_spec
        if config.restore_modelopt_state:
            return get_hybrid_stack_modelopt_spec(local_core_attention=False, remap_te_layernorm=False)
        return default_hybrid_stack_spec

    def build_model(
        self,
        pg_collection: ProcessGroupCollection,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        vp_stage: int | None = None,
    ) -> HybridModel:
        """One HybridModel stage; ``pre_process``/``post_process`` default to the stage's place in the pipeline."""
        config = self._model_config
        stack_spec = self._stack_spec()
        vocab_size = config._padded_vocab_size(calculate_padded_vocab_size)
        return HybridModel(
            config=config.transformer,
            hybrid_stack_spec=stack_spec,
            vocab_size=vocab_size,
            max_sequence_length=config.seq_length,
            hybrid_layer_pattern=config.hybrid_layer_pattern,
            fp16_lm_cross_entropy=config.fp16_lm_cross_entropy,
            parallel_output=config.parallel_output,
            share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
            position_embedding_type=config.position_embedding_type,
            rotary_percent=config.rotary_percent,
            rotary_base=config.rotary_base,
            seq_len_interpolation_factor=config.seq_len_interpolation_factor,
            pre_process=is_pp_first_stage(pg_collection.pp) if pre_process is None else pre_process,
            post_process=is_pp_last_stage(pg_collection.pp) if post_process is None else post_process,
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
        data_parallel_random_init: bool = False,
        mixed_precision_wrapper: Callable[[Any, MegatronModule], MegatronModule] | None = Float16Module,
        model_type: ModelType = ModelType.encoder_or_decoder,
    ) -> list[HybridModel]:
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
