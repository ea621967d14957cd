"""Activation offloading: tensors saved for backward move to host memory in forward and come back in backward.

Two of Megatron's switches use it:

- ``cpu_offloading`` with ``cpu_offloading_num_layers`` (``--cpu-offloading-num-layers N``): everything the first N
  transformer layers save for backward (``cpu_offloading_activations``; weights are never offloaded here);
- ``fine_grained_activation_offloading`` with ``offload_modules`` (``--fine-grained-activation-offloading
  --offload-modules core_attn attn_proj ...``): what the named submodules of every layer save, for tensors of at
  least ``min_offloaded_tensor_size`` elements.

Both are :class:`HostOffloadHooks`, a ``torch.autograd.graph.saved_tensors_hooks`` context: a saved activation is
copied into a new host buffer (pinned, the copy asynchronous, when CUDA is available) and the device tensor is
released with the forward's other temporaries; backward copies it back to the device it came from. The copies are
exact, so gradients are bit for bit those of the run without offloading. On a CPU-only machine the host buffer is a
separate host tensor, so the same path runs (and is tested) there.
"""

import fnmatch
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.utils import host_buffer_like

# Megatron's --offload-modules choices, each the submodule(s) of a TransformerLayer whose saved tensors it moves.
OFFLOAD_MODULE_PATTERNS: Dict[str, Tuple[str, ...]] = {
    "attn_norm": ("input_layernorm",),
    "qkv_linear": ("self_attention.linear_qkv",),
    "core_attn": ("self_attention.core_attention",),
    "attn_proj": ("self_attention.linear_proj",),
    "mlp_norm": ("pre_mlp_layernorm",),
    "expert_fc1": ("mlp.experts.linear_fc1", "mlp.experts.local_experts.*.linear_fc1"),
}
# Megatron's choice whose code is not a module here (the experts call their activation function inline).
_NOT_A_MODULE_HERE = ("moe_act",)


def _is_parameter_or_view_of_one(tensor: torch.Tensor) -> bool:
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


class HostOffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Within this context, floating-point tensors of at least ``min_tensor_size`` elements that autograd saves
    for backward (not parameters, which stay where they are) are kept in host memory until backward needs them.

    ``offloaded_bytes`` counts the bytes moved to the host (for tests and memory reports)."""

    def __init__(self, min_tensor_size: int = 0):
        self.min_tensor_size = min_tensor_size
        self.offloaded_bytes = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if (
            not tensor.is_floating_point()
            or tensor.numel() < self.min_tensor_size
            or tensor.device.type == "meta"
            or _is_parameter_or_view_of_one(tensor)
        ):
            return tensor
        host = host_buffer_like(tensor, pin=True)
        host.copy_(tensor, non_blocking=True)
        self.offloaded_bytes += host.numel() * host.element_size()
        return tensor.device, host

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=True)
        return packed


def layer_offload_context(config, layer_index: int, training: bool) -> Optional[HostOffloadHooks]:
    """The offloading context of the block's ``layer_index``-th layer (None: not offloaded): with
    ``cpu_offloading``, the first ``cpu_offloading_num_layers`` layers of a model being trained."""
    if not (config.cpu_offloading and config.cpu_offloading_activations and training and torch.is_grad_enabled()):
        return None
    if layer_index >= config.cpu_offloading_num_layers:
        return None
    return HostOffloadHooks()


def offloaded_submodules(layer: torch.nn.Module, offload_modules: List[str]) -> List[torch.nn.Module]:
    """The submodules of ``layer`` that ``offload_modules`` (Megatron's names) select."""
    patterns = [pattern for name in offload_modules for pattern in OFFLOAD_MODULE_PATTERNS[name]]
    return [
        module
        for name, module in layer.named_modules()
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)
    ]


def install_fine_grained_offloading(layer: torch.nn.Module, config) -> None:
    """Make every submodule that ``config.offload_modules`` names run its forward inside :class:`HostOffloadHooks`
    (tensors of at least ``config.min_offloaded_tensor_size`` elements) while the layer trains."""
    for module in offloaded_submodules(layer, config.offload_modules):
        module.register_forward_pre_hook(_enter_offloading(config.min_offloaded_tensor_size))
        module.register_forward_hook(_exit_offloading, always_call=True)


def _enter_offloading(min_tensor_size: int):
    def hook(module, args):
        if module.training and torch.is_grad_enabled():
            hooks = HostOffloadHooks(min_tensor_size)
            hooks.__enter__()
            module._active_offload_hooks = hooks

    return hook


def _exit_offloading(module, args, output):
    hooks = getattr(module, "_active_offload_hooks", None)
    if hooks is not None:
        module._active_offload_hooks = None
        hooks.__exit__(None, None, None)


def validate_offload_modules(offload_modules: List[str]) -> None:
    """Every name must be one of Megatron's choices that is a module here; one ValueError otherwise."""
    for name in offload_modules:
        if name in _NOT_A_MODULE_HERE:
            raise ValueError(
                f"offload_modules: not supported yet: {name!r} (the expert activation is not a separate module "
                f"here); use one of {sorted(OFFLOAD_MODULE_PATTERNS)}"
            )
        if name not in OFFLOAD_MODULE_PATTERNS:
            raise ValueError(
                f"offload_modules: {name!r} is not a module that can be offloaded; use one of "
                f"{sorted(OFFLOAD_MODULE_PATTERNS)}"
            )
