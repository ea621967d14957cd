"""Megatron's optimizer wrappers around a ``torch.optim`` optimizer.

- :class:`FP32Optimizer`: fp32 model; the torch optimizer steps the model parameters directly.
- :class:`Float16OptimizerWithFloat16Params`: fp16/bf16 model; the torch optimizer steps fp32 *main* copies, whose
  results are copied back into the model; fp16 adds loss scaling and skips steps whose gradients overflowed.
- :class:`ChainedOptimizer`: several of the above (e.g. dense and expert parameters) stepped as one, with one
  global gradient norm.
- ``DistributedOptimizer`` (distrib_optimizer.py) shards the main parameters and optimizer state over DP ranks.

Every ``step()`` returns ``(update_successful, grad_norm, num_zeros_in_grad)``. Gradients are read from
``param.main_grad`` (DDP's buffers) when present, else from ``param.grad``.
"""

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.dist_checkpointing.optimizer import (
    _param_group_override_keys,  # noqa: F401  (Megatron-Core 0.19 home of these two names)
    filter_and_reorder_param_groups,
    get_param_id_to_sharded_param_map,
    is_sharded_state,
    load_torch_optimizer_state,
    make_sharded_optimizer_tensor,
    mark_sharded_state,
    param_group_identifier_keys,  # noqa: F401
    saved_step_and_param_groups,
    shard_torch_optimizer_state,
)
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    counts_for_grad_stats,
    get_grad_norm_fp32,
)
from megatron.core.optimizer.distrib_optimizer_layouts import (
    BUCKET_SPACE_LAYOUTS,
    load_chained_parameter_state,
    save_chained_parameter_state,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.tensor_parallel.layers import copy_tensor_model_parallel_attributes
from megatron.core.utils import as_dtensor_like, get_current_device

_FLOAT16_DTYPES = (torch.float16, torch.bfloat16)
# Attributes that decide how a parameter counts in gradient statistics; main copies must carry them too.
_GRAD_STATS_ATTRIBUTES = ("shared", "sequence_parallel", "allreduce", "is_embedding_or_output_parameter")


def copy_optimizer_param_metadata(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Give a main (fp32) copy the tensor-parallel and sharing attributes of its model parameter."""
    copy_tensor_model_parallel_attributes(destination, source)
    for attribute in _GRAD_STATS_ATTRIBUTES:
        if hasattr(source, attribute):
            setattr(destination, attribute, getattr(source, attribute))


def _skips_update(config: OptimizerConfig, grad_norm: float) -> bool:
    """A gradient norm above ``grad_norm_skip_threshold`` (e.g. a loss spike) is not applied: it would move the
    weights and corrupt Adam's moments far more than skipping one step costs."""
    return grad_norm > config.grad_norm_skip_threshold


def _model_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _zero_grad_group_helper(params, set_to_none: bool) -> None:
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            param.grad.detach_().zero_()


class MegatronOptimizer(ABC):
    """Base class: gradient statistics, clipping and the step protocol around a torch optimizer.

    Args:
        optimizer: the torch optimizer (its param groups carry Megatron's ``wd_mult``/``lr_mult``/... keys).
        config: the OptimizerConfig.
        init_state_fn: ``fn(torch_optimizer, config)`` that creates empty optimizer state (used before loading).

    As in Megatron, the builder sets two attributes after construction: ``grad_stats_parallel_group``, the group
    gradient norms and zero counts are summed over (the model-parallel group; None means every rank), and
    ``tp_group``, the tensor-parallel group, to count replicated parameters once.
    """

    # Pairs saved param groups with the current ones by their identifier (param_group_identifier_keys).
    _filter_and_reorder_param_groups = staticmethod(filter_and_reorder_param_groups)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        init_state_fn: Callable = lambda optimizer, config=None: None,
    ):
        self.optimizer = optimizer
        self.config = config
        self.init_state_fn = init_state_fn
        self.grad_stats_parallel_group: Optional[dist.ProcessGroup] = None
        self.tp_group: Optional[dist.ProcessGroup] = None
        self._offloaded_state_devices: Optional[Dict[Tuple[int, str], torch.device]] = None

    # ---- parameters and gradients ----------------------------------------------------------------------------

    def get_parameters(self) -> List[torch.Tensor]:
        """The tensors the torch optimizer steps (model parameters, or main copies / shards of them)."""
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def get_grads_for_grad_norm(self, grad_norm_group: Optional[str] = None) -> List[torch.Tensor]:
        """Gradients this rank counts in a global norm (replicated and shared parameters counted once).

        Parameters tagged ``param.grad_norm_group = "<name>"`` form a separate norm (e.g. to log a detached head's
        gradients on their own): they are left out of the main norm (``grad_norm_group=None``) and returned for
        ``grad_norm_group="<name>"``. The step clips, and skips on, the main norm.
        """
        grads = ((param, self._main_grad_of(param)) for param in self.get_parameters())
        return [
            grad
            for param, grad in grads
            if grad is not None
            and getattr(param, "grad_norm_group", None) == grad_norm_group
            and counts_for_grad_stats(param, self.tp_group)
        ]

    @property
    def _use_decoupled_grad(self) -> bool:
        """The precision-aware optimizer keeps main gradients in ``param.decoupled_grad`` (Megatron's attribute):
        ``param.grad`` cannot hold a gradient of another dtype than its parameter's."""
        return self.config.use_precision_aware_optimizer

    def _main_grad_of(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        return getattr(param, "decoupled_grad" if self._use_decoupled_grad else "grad", None)

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        """Whether any rank of the grad-stats group holds parameters of ``grad_norm_group`` (the same answer on
        every rank, so that every rank issues the same collectives for that group's norm)."""
        local = any(getattr(p, "grad_norm_group", None) == grad_norm_group for p in self.get_parameters())
        # MAX acts as a logical OR, so every rank gets the same answer and issues the same collectives.
        found = torch.tensor([1.0 if local else 0.0], device=get_current_device())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.get_grad_stats_parallel_group())
        return found.item() > 0

    def get_grad_stats_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self.grad_stats_parallel_group

    def get_grad_norm(self):
        """Global L2 norm of the (unscaled) main gradients."""
        return get_grad_norm_fp32(
            self.get_grads_for_grad_norm(), grad_stats_parallel_group=self.get_grad_stats_parallel_group()
        )

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip the main gradients to a global norm of ``clip_grad``; return the norm before clipping."""
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self.get_parameters(), clip_grad, grad_norm, self._use_decoupled_grad)
        return grad_norm

    def count_zeros(self) -> float:
        return count_zeros_fp32(
            self.get_parameters(),
            grad_stats_parallel_group=self.get_grad_stats_parallel_group(),
            use_decoupled_grad=self._use_decoupled_grad,
            tp_group=self.tp_group,
        )

    # ---- loss scale ------------------------------------------------------------------------------------------

    def get_loss_scale(self) -> torch.Tensor:
        """The factor the loss is multiplied by before backward (1.0 without loss scaling)."""
        return torch.tensor([1.0], dtype=torch.float32, device=get_current_device())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.get_loss_scale() * loss

    # ---- the step --------------------------------------------------------------------------------------------

    @abstractmethod
    def prepare_grads(self) -> bool:
        """Move this step's gradients where the torch optimizer reads them; return True if they overflowed."""

    @abstractmethod
    def step_with_ready_grads(self) -> bool:
        """Run the torch optimizer and write the results back to the model; return whether it succeeded."""

    @torch.no_grad()
    def step(self):
        """One optimizer step: ``(update_successful, grad_norm, num_zeros_in_grad)``. An overflow skips the step
        and returns ``(False, None, None)``; a gradient norm above ``config.grad_norm_skip_threshold`` skips it
        and returns ``(False, grad_norm, num_zeros_in_grad)``."""
        if self.prepare_grads():
            return False, None, None
        # Summed over the grad-stats group, so every rank takes the same skip and clip decision.
        grad_norm = self.get_grad_norm()
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        if _skips_update(self.config, grad_norm):
            self.zero_grad(set_to_none=True)
            return False, grad_norm, num_zeros
        if self.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                self.get_parameters(), self.config.clip_grad, grad_norm, self._use_decoupled_grad
            )
        return self.step_with_ready_grads(), grad_norm, num_zeros

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True):
        pass

    @abstractmethod
    def reload_model_params(self, state_dict=None):
        """Refresh the optimizer's main parameters from the model's (after the model was loaded from disk).
        ``state_dict`` (the loaded model state) is accepted for Megatron's signature: the model parameters already
        hold it."""

    def prepare_model_params_for_param_sync(self) -> None:
        """Get the model parameters ready for their all-gather after a step. Only fp8 parameters need work here
        (re-quantising from the main copies), and none are built, so there is nothing to do."""

    # ---- optimizer state on the host ---------------------------------------------------------------------------

    def offload_to_cpu(self):
        """Move the optimizer state (e.g. Adam's moments) to host memory, freeing accelerator memory while the
        optimizer is idle (e.g. during inference); :meth:`restore_from_cpu` moves it back."""
        if self._offloaded_state_devices is not None:
            return
        self._offloaded_state_devices = {}
        for state in self.optimizer.state.values():
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    self._offloaded_state_devices[id(state), name] = value.device
                    state[name] = value.to("cpu")

    def restore_from_cpu(self):
        """Move the state that :meth:`offload_to_cpu` offloaded back to where it was."""
        if self._offloaded_state_devices is None:
            return
        for state in self.optimizer.state.values():
            for name, value in state.items():
                device = self._offloaded_state_devices.get((id(state), name))
                if device is not None:
                    state[name] = value.to(device)
        self._offloaded_state_devices = None

    # ---- state -----------------------------------------------------------------------------------------------

    @abstractmethod
    def state_dict(self):
        pass

    @abstractmethod
    def load_state_dict(self, state_dict):
        pass

    @abstractmethod
    def sharded_state_dict(
        self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, metadata: Optional[dict] = None
    ) -> Dict[str, Any]:
        """This optimizer's state as pieces of the global (dist_checkpointing) checkpoint."""

    def owned_main_params(self) -> List[torch.Tensor]:
        """Main parameters this optimizer allocated itself (not views of the model's parameters)."""
        return []

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: owned main parameters plus the per-element optimizer state
        (tensors shaped like their parameter, e.g. Adam's moments; scalar step counters are not counted)."""
        total = sum(p.numel() * p.element_size() for p in self.owned_main_params())
        for param, state in self.optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    total += value.numel() * value.element_size()
        return total

    @property
    def param_groups(self) -> List[Dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value


class MixedPrecisionOptimizer(MegatronOptimizer):
    """Shared step logic of optimizers that keep fp32 main gradients apart from the model's gradients."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: Optional[MegatronGradScaler],
        init_state_fn: Callable,
    ):
        super().__init__(optimizer, config, init_state_fn)
        if config.fp16 and grad_scaler is None:
            raise ValueError("fp16 training needs a grad scaler (ConstantGradScaler or DynamicGradScaler)")
        self.grad_scaler = grad_scaler
        # A device tensor reused every step: the fused unscale kernel writes into it and it is all-reduced.
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=get_current_device())

    def get_loss_scale(self):
        if self.grad_scaler is None:
            return super().get_loss_scale()
        return self.grad_scaler.scale

    @abstractmethod
    def _copy_model_grads_to_main_grads(self) -> None:
        pass

    @abstractmethod
    def _copy_main_params_to_model_params(self) -> None:
        pass

    def _main_grads(self) -> List[torch.Tensor]:
        grads = (self._main_grad_of(param) for param in self.get_parameters())
        return [grad for grad in grads if grad is not None]

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        """Divide the main gradients by the loss scale; True if any rank found a NaN/Inf among them."""
        self.found_inf.fill_(0.0)
        grads = self._main_grads()
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.grad_scaler.inv_scale)
        if dist.is_available() and dist.is_initialized():
            # If any rank overflowed, all skip the step together; otherwise their replicas would diverge.
            dist.all_reduce(self.found_inf, op=dist.ReduceOp.MAX, group=self.get_grad_stats_parallel_group())
        return self.found_inf.item() > 0

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        self._copy_model_grads_to_main_grads()
        if self.grad_scaler is None:
            return False
        found_inf = self._unscale_main_grads_and_check_for_nan()
        # Update before the skip so that an overflow still lowers the loss scale.
        self.grad_scaler.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True

    @torch.no_grad()
    def step(self):
        """Unscale the main gradients and skip the step on an overflow (fp16), then clip and step the main
        parameters and copy them into the model; ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        return super().step()

    @abstractmethod
    def reload_model_params(self, state_dict=None):
        pass


class Float16OptimizerWithFloat16Params(MixedPrecisionOptimizer):
    """Steps fp32 main copies of a bf16/fp16 model's parameters (fp32 model parameters are stepped as they are)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        grad_scaler: MegatronGradScaler,
        init_state_fn: Callable,
    ):
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        self.float16_groups: List[List[torch.nn.Parameter]] = []
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.nn.Parameter]] = []
        for group in self.optimizer.param_groups:
            float16_params, main_params, fp32_params = [], [], []
            for i, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in _FLOAT16_DTYPES:
                    # A separate fp32 master copy, so small updates are not rounded away in bf16/fp16.
                    main_param = param.detach().clone().float()
                    copy_optimizer_param_metadata(main_param, param)
                    group["params"][i] = main_param
                    float16_params.append(param)
                    main_params.append(main_param)
                    # Existing state follows the parameter to the main copy the optimizer now steps.
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                else:
                    raise TypeError(
                        f"Float16OptimizerWithFloat16Params: parameter of dtype {param.dtype} is not supported; "
                        "parameters must be float16, bfloat16 or float32"
                    )
            self.float16_groups.append(float16_params)
            self.fp32_from_float16_groups.append(main_params)
            self.fp32_from_fp32_groups.append(fp32_params)

    def owned_main_params(self) -> List[torch.Tensor]:
        return [p for group in self.fp32_from_float16_groups for p in group]

    def zero_grad(self, set_to_none=True):
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                grad = _model_grad(model_param)
                # float() copies into fp32; the half-precision .grad is then dropped to free its memory.
                main_param.grad = None if grad is None else grad.float()
                model_param.grad = None
        for group in self.fp32_from_fp32_groups:
            for param in group:
                if getattr(param, "main_grad", None) is not None:
                    # fp32 parameters are stepped directly: alias .grad to DDP's buffer instead of copying.
                    param.grad = param.main_grad

    def _copy_main_params_to_model_params(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                model_param.data.copy_(main_param)
        _release_main_grad_aliases(self.fp32_from_fp32_groups)

    def reload_model_params(self, state_dict=None):
        with torch.no_grad():
            for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
                for model_param, main_param in zip(model_group, main_group):
                    main_param.copy_(model_param)

    def state_dict(self, is_loading: bool = False):
        """The torch optimizer's state, the fp32 main copies and the loss scaler. With ``is_loading``, empty
        optimizer state is created first, so that the result holds a tensor for everything a checkpoint fills."""
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "fp32_from_fp16_params": [[p.detach() for p in group] for group in self.fp32_from_float16_groups],
        }
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict):
        if is_sharded_state(state_dict):
            return self._load_sharded_state_dict(state_dict)
        _require_keys(state_dict, ("optimizer", "fp32_from_fp16_params"), type(self).__name__)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        saved = state_dict["fp32_from_fp16_params"]
        if [len(g) for g in saved] != [len(g) for g in self.fp32_from_float16_groups]:
            raise ValueError(
                "fp32_from_fp16_params in the state dict has groups of sizes "
                f"{[len(g) for g in saved]}, this optimizer {[len(g) for g in self.fp32_from_float16_groups]}; "
                "the checkpoint was written for a different model or parallel layout"
            )
        with torch.no_grad():
            for main_group, saved_group in zip(self.fp32_from_float16_groups, saved):
                for main_param, saved_param in zip(main_group, saved_group):
                    main_param.copy_(saved_param)

    def _model_params_in_optimizer_order(self) -> List[torch.Tensor]:
        model_of_main = {
            id(main): model
            for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups)
            for model, main in zip(model_group, main_group)
        }
        # fp32 parameters are their own main parameter, so they map to themselves.
        return [model_of_main.get(id(param), param) for param in self.get_parameters()]

    def sharded_state_dict(
        self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, metadata: Optional[dict] = None
    ):
        """This optimizer's state as pieces of the global checkpoint, keyed by the model parameters' keys.

        Adam's moments are stored as ``optimizer.state.<name>.<param key>`` and the fp32 main copies of fp16/bf16
        parameters as ``optimizer.state.fp32_param.<param key>``, sharded like their parameters, so they reshard
        with the model. ``model_sharded_state_dict`` holds the model chunks' sharded state dicts. With
        ``is_loading`` empty state is created first so that every tensor to load into exists. ``metadata`` is
        accepted for Megatron's signature.
        """
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        model_params = self._model_params_in_optimizer_order()
        optimizer_state = shard_torch_optimizer_state(
            self.optimizer.state_dict(), model_sharded_state_dict, model_params
        )
        id_to_sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, model_params)
        fp32_params = {}
        for index, (model_param, main_param) in enumerate(zip(model_params, self.get_parameters())):
            # Only bf16/fp16 parameters have a separate fp32 copy worth saving.
            if main_param is not model_param:
                fp32_params[index] = make_sharded_optimizer_tensor(
                    id_to_sharded[index], main_param, "optimizer.state.fp32_param"
                )
        state = {"optimizer": optimizer_state, "fp32_from_fp16_params": fp32_params}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return mark_sharded_state(state)

    def _load_sharded_state_dict(self, state_dict: Dict) -> None:
        step, saved_groups = saved_step_and_param_groups(state_dict)
        per_param_state = _per_param_tensors(state_dict["optimizer"]["state"])
        load_torch_optimizer_state(self.optimizer, per_param_state, step, saved_groups)
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        main_params = self.get_parameters()
        with torch.no_grad():
            for index, saved_param in state_dict.get("fp32_from_fp16_params", {}).items():
                main_params[index].copy_(as_dtensor_like(saved_param, main_params[index]))


def _per_param_tensors(loaded_state: Dict) -> Dict[int, Dict[str, torch.Tensor]]:
    """The loaded per-parameter entries of a sharded optimizer state (everything but ``common_step``)."""
    return {index: param_state for index, param_state in loaded_state.items() if index != "common_step"}


def _release_main_grad_aliases(groups) -> None:
    """Drop ``.grad`` where it was pointed at DDP's ``main_grad``: autograd would otherwise accumulate into it and
    the DDP hook would add the same gradient to the buffer a second time."""
    for group in groups:
        for param in group:
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None and param.grad is main_grad:
                param.grad = None


def _require_keys(state_dict: Dict, keys, owner: str) -> None:
    missing = [key for key in keys if key not in state_dict]
    if missing:
        raise KeyError(f"{owner} state dict lacks {missing}; it has {sorted(state_dict)}")


class FP32Optimizer(MegatronOptimizer):
    """An fp32 model stepped directly by the torch optimizer (no main copies, no loss scaling)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, init_state_fn: Callable):
        super().__init__(optimizer, config, init_state_fn)
        self._unit_scale = torch.tensor([1.0], dtype=torch.float32, device=get_current_device())

    def get_loss_scale(self):
        """Always 1.0: an fp32 model is not loss-scaled."""
        return self._unit_scale

    @torch.no_grad()
    def step(self):
        """Clip, then step the model parameters; ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        return super().step()

    def zero_grad(self, set_to_none=True):
        for group in self.optimizer.param_groups:
            _zero_grad_group_helper(group["params"], set_to_none)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        for param in self.get_parameters():
            if getattr(param, "main_grad", None) is not None:
                param.grad = param.main_grad
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        _release_main_grad_aliases([group["params"] for group in self.optimizer.param_groups])
        return True

    def reload_model_params(self, state_dict=None):
        """Nothing to refresh: the torch optimizer steps the model parameters themselves."""

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        if is_sharded_state(state_dict):
            return self._load_sharded_state_dict(state_dict)
        self.optimizer.load_state_dict(state_dict)

    def sharded_state_dict(
        self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, metadata: Optional[dict] = None
    ):
        """The torch optimizer's state with each per-parameter tensor stored as ``optimizer.state.<name>.<param
        key>``, sharded like its parameter (see Float16OptimizerWithFloat16Params.sharded_state_dict)."""
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        return mark_sharded_state(
            shard_torch_optimizer_state(self.optimizer.state_dict(), model_sharded_state_dict, self.get_parameters())
        )

    def _load_sharded_state_dict(self, state_dict: Dict) -> None:
        step, saved_groups = saved_step_and_param_groups(state_dict)
        load_torch_optimizer_state(self.optimizer, _per_param_tensors(state_dict["state"]), step, saved_groups)


class ProxyDict(Mapping):
    """A read/write view of several dicts with disjoint keys as one (ChainedOptimizer.state): a lookup or an
    update goes to the dict that holds the key."""

    def __init__(self, inner_dicts: List[dict]):
        self._inner_dicts = inner_dicts

    def _owner(self, key) -> dict:
        for inner in self._inner_dicts:
            if key in inner:
                return inner
        raise KeyError(key)

    def __getitem__(self, key):
        return self._owner(key)[key]

    def __setitem__(self, key, value):
        self._owner(key)[key] = value

    def __iter__(self):
        return (key for inner in self._inner_dicts for key in inner)

    def __len__(self) -> int:
        return sum(len(inner) for inner in self._inner_dicts)

    def items(self):
        """(key, value) pairs of every inner dict in turn."""
        return ((key, value) for inner in self._inner_dicts for key, value in inner.items())


class ChainedOptimizer(MegatronOptimizer):
    """Several optimizers (e.g. dense and expert parameters) stepped together with one global gradient norm."""

    def __init__(self, chained_optimizers: List[MegatronOptimizer]):
        if not chained_optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        self.chained_optimizers = list(chained_optimizers)
        self.config = chained_optimizers[0].config

    @property
    def optimizer(self):
        raise AttributeError("ChainedOptimizer has no single torch optimizer; see .chained_optimizers")

    @property
    def param_groups(self) -> List[Dict]:
        return [group for opt in self.chained_optimizers for group in opt.param_groups]

    @property
    def state(self):
        """One live view of every chained optimizer's per-parameter state."""
        return ProxyDict([opt.state for opt in self.chained_optimizers])

    def get_parameters(self) -> List[torch.nn.Parameter]:
        return [param for opt in self.chained_optimizers for param in opt.get_parameters()]

    def get_loss_scale(self):
        return self.chained_optimizers[0].get_loss_scale()

    def get_grad_stats_parallel_group(self) -> torch.distributed.ProcessGroup:
        """The one group all chained optimizers reduce statistics over (see grads_states_parallel_group_is_shared)."""
        if not self.grads_states_parallel_group_is_shared():
            raise ValueError(
                "ChainedOptimizer: the chained optimizers reduce gradient statistics over different groups; ask "
                "each of .chained_optimizers"
            )
        return self.chained_optimizers[0].get_grad_stats_parallel_group()

    def grads_states_parallel_group_is_shared(self):
        """Whether every chained optimizer reduces gradient statistics over the same group."""
        groups = [opt.get_grad_stats_parallel_group() for opt in self.chained_optimizers]
        return all(group is groups[0] for group in groups)

    def has_grad_norm_group(self, grad_norm_group: str) -> bool:
        # Every chained optimizer answers, so that each one's collective runs on every rank.
        return any([opt.has_grad_norm_group(grad_norm_group) for opt in self.chained_optimizers])

    def get_grad_norm(self):
        # The L2 norm over disjoint parameter sets: the root of the summed squared norms.
        return math.sqrt(sum(opt.get_grad_norm() ** 2 for opt in self.chained_optimizers))

    def count_zeros(self):
        return sum(opt.count_zeros() for opt in self.chained_optimizers)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        # Every optimizer prepares (and updates its loss scaler) even after another one found an overflow.
        found = [opt.prepare_grads() for opt in self.chained_optimizers]
        return any(found)

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        # A list, not a generator: every optimizer must step even if an earlier one reports failure.
        return all([opt.step_with_ready_grads() for opt in self.chained_optimizers])

    def prepare_model_params_for_param_sync(self) -> None:
        for opt in self.chained_optimizers:
            opt.prepare_model_params_for_param_sync()

    @torch.no_grad()
    def step(self):
        """One step of every chained optimizer, clipped and skipped on the global norm of all of them."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = self.get_grad_norm()
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        # One decision for all: stepping only some of the chained optimizers would desynchronise them.
        if any(_skips_update(opt.config, grad_norm) for opt in self.chained_optimizers):
            self.zero_grad(set_to_none=True)
            return False, grad_norm, num_zeros
        for opt in self.chained_optimizers:
            if opt.config.clip_grad > 0.0:
                # Against the global norm: with equal clip_grad, every chained gradient is scaled by the same factor.
                clip_grad_by_total_norm_fp32(
                    opt.get_parameters(), opt.config.clip_grad, grad_norm, opt._use_decoupled_grad
                )
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def zero_grad(self, set_to_none=True):
        for opt in self.chained_optimizers:
            opt.zero_grad(set_to_none)

    def reload_model_params(self, state_dict=None):
        for opt in self.chained_optimizers:
            opt.reload_model_params(state_dict)

    def offload_to_cpu(self):
        for opt in self.chained_optimizers:
            opt.offload_to_cpu()

    def restore_from_cpu(self):
        for opt in self.chained_optimizers:
            opt.restore_from_cpu()

    def state_bytes(self) -> int:
        return sum(opt.state_bytes() for opt in self.chained_optimizers)

    def state_dict(self):
        return [opt.state_dict() for opt in self.chained_optimizers]

    # The legacy distrib_optim.pt of the chained distributed optimizers (see distrib_optimizer_layouts).
    save_parameter_state = save_chained_parameter_state
    load_parameter_state = load_chained_parameter_state

    def load_state_dict(self, state_dict):
        if is_sharded_state(state_dict):  # a single chained optimizer's sharded state (see sharded_state_dict)
            state_dict = [state_dict]
        elif isinstance(state_dict, dict):  # several sharded states, by optimizer index
            state_dict = [state for _, state in sorted(state_dict.items())]
        if len(state_dict) != len(self.chained_optimizers):
            raise ValueError(
                f"ChainedOptimizer: the state dict holds {len(state_dict)} optimizer states, this optimizer chains "
                f"{len(self.chained_optimizers)}; the checkpoint was written for a different model"
            )
        for opt, opt_state in zip(self.chained_optimizers, state_dict):
            opt.load_state_dict(opt_state)

    def sharded_state_dict(self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, **kwargs):
        """Each chained optimizer's sharded state, by index (a single optimizer's state is returned as it is).

        As in Megatron, the keys are prefixed ``chained_<index>.`` unless ``metadata['chained_optim_avoid_prefix']``
        is set and no bucket-space distributed-optimizer layout is asked for (model-space keys are unique already;
        the bucket-space ones would collide between the dense and the expert optimizer)."""
        if len(self.chained_optimizers) == 1:
            return self.chained_optimizers[0].sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
        metadata = kwargs.get("metadata") or {}
        add_prefix = metadata.get("distrib_optim_sharding_type") in BUCKET_SPACE_LAYOUTS or not metadata.get(
            "chained_optim_avoid_prefix", False
        )
        sharded_state_dict = {}
        for index, opt in enumerate(self.chained_optimizers):
            opt_state = opt.sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)
            if add_prefix:
                add_prefix_for_sharding(opt_state, f"chained_{index}.")
            sharded_state_dict[index] = opt_state
        return sharded_state_dict
