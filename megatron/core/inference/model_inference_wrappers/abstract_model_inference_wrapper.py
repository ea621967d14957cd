"""Running one forward step of a model at inference: eval mode, no autograd, pipeline stages in lockstep.

The wrapper hides model parallelism from the controller: under pipeline parallelism every stage calls
:meth:`run_one_forward_step` with the same inputs; a stage receives the previous stage's hidden states, runs its
layers and sends them on; the last stage gathers the vocabulary-parallel logits over tensor-parallel ranks and
returns full-vocabulary logits ``[b, s, v]``; the other stages return None.
"""

import abc
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.utils import get_attr_wrapped_model, get_model_config


class AbstractModelInferenceWrapper(abc.ABC):
    """Wraps a model (possibly inside DDP / Float16Module) for inference with an ``inference_context``."""

    def __init__(self, model, inference_context=None):
        if isinstance(model, (list, tuple)):
            if len(model) != 1:
                raise ValueError(
                    f"inference takes one model chunk, got {len(model)}: virtual pipeline stages are not supported "
                    "at inference; load the checkpoint without --num-layers-per-virtual-pipeline-stage"
                )
            model = model[0]
        self.model = model
        self.model.eval()  # no dropout at inference, whichever driver runs the steps
        self.config = get_model_config(model)
        if self.config.sequence_parallel:
            raise ValueError(
                "inference runs without sequence parallelism: build the model with sequence_parallel=False "
                "(drop --sequence-parallel; the checkpoint loads the same)"
            )
        if self.config.context_parallel_size != 1:
            raise ValueError(f"inference runs with context_parallel_size=1, got {self.config.context_parallel_size}")
        self.inference_context = inference_context
        self.pre_process = get_attr_wrapped_model(model, "pre_process")
        self.post_process = get_attr_wrapped_model(model, "post_process")
        self.pipelined = parallel_state.model_parallel_is_initialized() and (
            parallel_state.get_pipeline_model_parallel_world_size() > 1
        )
        self.mamba_mixers = _mamba_mixers(model)
        column_major_linear_weights_on_cpu(model)

    def prep_model_for_inference(self, prompts_tokens: Optional[torch.Tensor] = None):
        """Eval mode (no dropout). ``prompts_tokens`` is accepted for Megatron's older signature."""
        self.model.eval()

    @abc.abstractmethod
    def prep_inference_input(self, prompts_tokens: torch.Tensor) -> Dict[str, Any]:
        """The model inputs for a padded batch of prompts."""

    @abc.abstractmethod
    def get_batch_for_context_window(self, inference_input, context_start_position, context_end_position):
        """The inputs of positions ``[start, end)``."""

    @property
    def _hidden_dtype(self) -> torch.dtype:
        return self.config.params_dtype

    @torch.inference_mode()
    def run_one_forward_step(self, inference_input: Dict[str, Any]) -> Optional[torch.Tensor]:
        """One forward over ``inference_input`` (``tokens [b, s]``, ``position_ids [b, s]``,
        ``attention_mask``); full-vocabulary logits ``[b, s, v]`` on the last stage, None elsewhere.

        With ``inference_input["logits_positions"]`` (an index tensor over the sequence dimension) the output
        layer runs only for those positions and the logits are ``[b, len(positions), v]``: decoding needs the last
        token's logits only, and the output layer over a whole prompt costs as much as several layers."""
        tokens = inference_input["tokens"]
        positions = inference_input.get("logits_positions")
        hook = None
        if positions is not None and self.post_process:

            def select_positions(module, args, kwargs):
                return (args[0].index_select(0, positions),) + tuple(args[1:]), kwargs

            output_layer = get_attr_wrapped_model(self.model, "output_layer")
            hook = output_layer.register_forward_pre_hook(select_positions, with_kwargs=True)
        try:
            return self._forward(tokens, inference_input)
        finally:
            if hook is not None:
                hook.remove()

    def _forward(self, tokens: torch.Tensor, inference_input: Dict[str, Any]) -> Optional[torch.Tensor]:
        if self.pipelined and not self.pre_process:
            b, s = tokens.shape
            received = torch.empty(s, b, self.config.hidden_size, dtype=self._hidden_dtype, device=tokens.device)
            dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
            get_attr_wrapped_model(self.model, "set_input_tensor")(received)
        if self.mamba_mixers:
            # A hybrid's Mamba layers keep conv/SSM states in the context, which sizes them from the mixers.
            self.inference_context.set_mamba_layers(self.mamba_mixers)
        output = self.model(
            tokens,
            inference_input["position_ids"],
            inference_input.get("attention_mask"),
            inference_context=self.inference_context,
        )
        if self.pipelined and not self.post_process:
            dist.send(
                output.to(self._hidden_dtype).contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank()
            )
            return None
        if get_attr_wrapped_model(self.model, "parallel_output"):
            output = gather_from_tensor_model_parallel_region(output)
        return output


def column_major_linear_weights_on_cpu(model) -> int:
    """Store the CPU weights that go through ``F.linear`` column-major: the same ``[out, in]`` tensors with the
    same values, in the memory order of their transpose. A decode step is matrix-vector products with weights far
    larger than the cache, and CPU BLAS streams a ``[in, out]`` row-major matrix past one input row about 30%
    faster than an ``[out, in]`` one (see docs/benchmarks.md); at batch 8 and above, and in prefill, the two are
    within a few percent. The word embedding counts when the output layer shares it: a lookup of scattered
    columns costs far less than the output layer gains. Like ``model.to(memory_format=...)`` this changes only
    strides: state dicts, checkpoints and outputs keep their shapes and values. Returns the number of weights
    changed; CUDA weights are left alone (cuBLAS is indifferent), and so is a model inside DistributedDataParallel,
    whose parameters are views of its contiguous buffers (a model trained between generations, as in RL)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    wrapper = model
    while hasattr(wrapper, "module"):
        if isinstance(wrapper, DistributedDataParallel):
            return 0
        wrapper = wrapper.module
    weights = {}
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None:
            weights[id(module.weight)] = module.weight
        elif isinstance(module, LanguageModule) and module.share_embeddings_and_output_weights and module.post_process:
            weight = module.shared_embedding_or_output_weight()
            weights[id(weight)] = weight
    changed = 0
    for weight in weights.values():
        if weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous():
            weight.data = weight.data.t().contiguous().t()
            changed += 1
    return changed


def _mamba_mixers(model) -> Dict[int, Any]:
    """This stage's Mamba mixers by the layer number they ask the context for (``layer_number -
    pp_layer_offset``); empty for a model without Mamba layers."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    return {
        module.layer_number - module.pp_layer_offset: module
        for module in model.modules()
        if isinstance(module, MambaMixer)
    }
