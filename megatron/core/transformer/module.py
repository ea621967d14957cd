"""MegatronModule: the base class of every Megatron-Core model component."""

from typing import Any, Dict, Optional, Tuple

import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.tensor_parallel.sharded_state import make_sharded_tensors_for_checkpoint
from megatron.core.transformer.utils import sharded_state_dict_default


_SYMMETRIC_AR_TYPES = (None, "two_shot", "one_shot", "multimem_all_reduce")


class MegatronModule(torch.nn.Module):
    """A ``torch.nn.Module`` that carries its :class:`TransformerConfig`."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The state dict to put in a checkpoint (Megatron's hook; the plain state dict here)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def set_is_first_microbatch(self):
        """Tell every submodule that caches weights (FP8 / TE) that a new micro-batch sequence starts; without a
        quantized mode (fp8, fp4, kitchen or a quant_recipe) there is no cache and nothing is touched."""
        config = self.config
        quantized = getattr(config, "fp8", None) is not None or getattr(config, "fp4", None) is not None
        quantized = quantized or getattr(config, "quant_recipe", None) is not None
        if not (quantized or getattr(config, "use_kitchen", False)):
            return
        for module in self.modules():
            if hasattr(module, "is_first_microbatch"):
                module.is_first_microbatch = True

    def set_symmetric_ar(self, set_to: Optional[str] = None) -> None:
        """Switch NCCL symmetric-memory all-reduce (``'two_shot'``, ``'one_shot'``, ``'multimem_all_reduce'``) on
        or off (None) for every submodule that offers it (an attribute ``symmetric_ar_type``, Transformer Engine's
        linears). This project's layers all-reduce through torch.distributed and offer none, like the config's
        ``symmetric_ar_type`` knob; an unknown choice is a ``ValueError``."""
        if set_to not in _SYMMETRIC_AR_TYPES:
            raise ValueError(f"set_symmetric_ar: set_to={set_to!r} is not one of {_SYMMETRIC_AR_TYPES}")
        for module in self.modules():
            if hasattr(module, "symmetric_ar_type"):
                module.symmetric_ar_type = set_to

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: Tuple[Tuple[int, int, int], ...] = (),
        metadata: Optional[dict] = None,
    ) -> Dict[str, Any]:
        """This module's state as pieces of the global checkpoint (see megatron.core.dist_checkpointing).

        By default the module's own parameters, persistent buffers and extra state are replicated over the
        tensor- and data-parallel ranks, and each child contributes its own ``sharded_state_dict`` (or, for a plain
        torch module, its replicated state dict). ``sharded_offsets`` are the axes prepended to every tensor (a
        block's layer axis); ``metadata`` is passed down unchanged. Keys of the returned dict are this module's
        ``state_dict`` names, so a loaded result feeds straight into ``load_state_dict``.
        """
        own_state = {}
        self._save_to_state_dict(own_state, "", keep_vars=True)
        sharded_state_dict = make_sharded_tensors_for_checkpoint(own_state, prefix, sharded_offsets=sharded_offsets)
        for name, module in self.named_children():
            sharded_state_dict.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata))
        return sharded_state_dict


# ---- mixed precision: Float16Module and its helpers ----------------------------------------------------------------

_FLOAT16_DTYPES = (torch.float16, torch.bfloat16)


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for the duplicate copy of a weight held on another stage (``param.shared``), e.g. a tied output layer."""
    return not getattr(param, "shared", False)


def conversion_helper(val, conversion):
    """Apply ``conversion`` to ``val``, or to every element of (nested) tuples and lists of it."""
    if isinstance(val, (tuple, list)):
        converted = [conversion_helper(item, conversion) for item in val]
        return tuple(converted) if isinstance(val, tuple) else converted
    return conversion(val)


def fp32_to_float16(val, float16_convertor):
    """Convert fp32 tensors in ``val`` with ``float16_convertor`` (e.g. ``lambda t: t.bfloat16()``)."""

    def convert(item):
        if isinstance(item, torch.Tensor) and item.dtype == torch.float32:
            return float16_convertor(item)
        return item

    return conversion_helper(val, convert)


def float16_to_fp32(val):
    """Convert fp16/bf16 tensors in ``val`` to fp32."""

    def convert(item):
        if isinstance(item, torch.Tensor) and item.dtype in _FLOAT16_DTYPES:
            return item.float()
        return item

    return conversion_helper(val, convert)


class Float16Module(MegatronModule):
    """Run ``module`` in fp16 or bf16 (``config.fp16`` / ``config.bf16``).

    The wrapped module's parameters and buffers are cast once; floating inputs are cast on the first pipeline stage
    and outputs are returned in fp32 on the last (unless ``forward(..., fp32_output=False)``), so losses are
    computed and reported in fp32. The optimizer keeps
    fp32 main parameters (Float16OptimizerWithFloat16Params / DistributedOptimizer).
    """

    # megatron.core.utils.unwrap_model strips classes that carry this marker.
    _megatron_model_wrapper = True

    def __init__(self, config: TransformerConfig, module: torch.nn.Module):
        super().__init__(config)
        if config.fp16 == config.bf16:
            raise ValueError(
                f"Float16Module needs exactly one of config.fp16 / config.bf16 set (got fp16={config.fp16}, "
                f"bf16={config.bf16})"
            )
        self.fp16, self.bf16 = config.fp16, config.bf16
        dtype = torch.float16 if config.fp16 else torch.bfloat16
        self.add_module("module", module.to(dtype))
        self.float16_convertor = lambda tensor: tensor.to(dtype)

    def set_input_tensor(self, input_tensor):
        return self.module.set_input_tensor(input_tensor)

    def _is_stage(self, attribute: str, check) -> bool:
        value = getattr(self.module, attribute, None)
        if value is not None:
            return bool(value)
        from megatron.core import parallel_state

        return not parallel_state.model_parallel_is_initialized() or check(ignore_virtual=False)

    def forward(self, *inputs, fp32_output=True, **kwargs):
        from megatron.core import parallel_state

        if self._is_stage("pre_process", parallel_state.is_pipeline_first_stage):
            inputs = fp32_to_float16(inputs, self.float16_convertor)
            kwargs = {key: fp32_to_float16(value, self.float16_convertor) for key, value in kwargs.items()}
        outputs = self.module(*inputs, **kwargs)
        if fp32_output and self._is_stage("post_process", parallel_state.is_pipeline_last_stage):
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        if hasattr(self.module, "state_dict_for_save_checkpoint"):
            return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix="", *args, **kwargs):
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
