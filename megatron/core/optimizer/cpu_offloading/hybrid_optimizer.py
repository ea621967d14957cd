"""HybridDeviceOptimizer: a fraction of the parameters is stepped on the host, the rest on the device.

Megatron's ``--optimizer-cpu-offload``: optimizer state is the largest part of a model's training memory (Adam: 8
bytes per parameter next to 2-4 for the weights), so ``offload_fraction`` of the parameters (counted in elements:
in parameter order, each whole parameter that still fits in the fraction) keep their state, a host copy of the
parameter and a host gradient buffer in host memory and are stepped there by ``cpu_optimizer_cls``; the rest stay
on the device with ``gpu_optimizer_cls``. Each step copies the offloaded gradients device-to-host, steps both parts,
and copies the updated parameters back.

With CUDA the host buffers are pinned and the copies are asynchronous; ``overlap_cpu_optimizer_d2h_h2d`` queues the
gradient copies on a side stream so that they run while the device part steps. Without CUDA the device is the host
itself: the same code runs (copies between two host buffers), so a CPU run checks the path, and the result equals
the plain optimizer's bit for bit (the same kernels on the same values).

The sub-optimizers are built from the param groups as they are at the first step (or the first ``init_state``), so a
wrapper may first swap the parameters for main copies or shards, as the mixed-precision and distributed optimizers
do. ``state`` is keyed by the parameters this optimizer was given, each entry being the very dict its sub-optimizer
holds (host tensors for offloaded parameters), so checkpoint code reads and fills it like any torch optimizer's.
"""

from typing import Dict, List, Optional, Tuple, Type

import torch

from megatron.core.utils import host_buffer_like, side_stream, stream_context, wait_stream


class HybridDeviceOptimizer(torch.optim.Optimizer):
    """Steps the first ``offload_fraction`` of the parameters (by element count) on the host, the rest where they
    are (see the module docstring).

    Args:
        params: parameters or param groups, as for any torch optimizer.
        offload_fraction: the fraction in [0, 1] of the elements to step on the host.
        cpu_optimizer_cls / gpu_optimizer_cls: torch optimizer classes of the two parts (default torch.optim.AdamW).
        param_update_in_fp32: keep the host copies of half-precision parameters in fp32.
        pin_cpu_grads / pin_cpu_params: page-lock the host gradient / parameter buffers (with CUDA only).
        overlap_cpu_optimizer_d2h_h2d: copy on a side stream while the device part steps (with CUDA only).
        **kwargs: the optimizers' hyper-parameters (lr, betas, weight_decay, fused, ...), the defaults of every group.
    """

    def __init__(
        self,
        params,
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Optional[Type[torch.optim.Optimizer]] = None,
        gpu_optimizer_cls: Optional[Type[torch.optim.Optimizer]] = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        **kwargs,
    ):
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"HybridDeviceOptimizer: offload_fraction={offload_fraction} is outside [0, 1]")
        super().__init__(params, defaults=kwargs)
        self.offload_fraction = offload_fraction
        self.cpu_optimizer_cls = cpu_optimizer_cls or torch.optim.AdamW
        self.gpu_optimizer_cls = gpu_optimizer_cls or torch.optim.AdamW
        self.param_update_in_fp32 = param_update_in_fp32
        self.pin_cpu_grads = pin_cpu_grads
        self.pin_cpu_params = pin_cpu_params
        self.overlap_cpu_optimizer_d2h_h2d = overlap_cpu_optimizer_d2h_h2d
        self.sub_optimizers: Optional[List[torch.optim.Optimizer]] = None
        # (device parameter, its host copy, the host gradient buffer) of every offloaded parameter.
        self.offloaded: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._owner: Dict[torch.Tensor, Tuple[torch.optim.Optimizer, torch.Tensor]] = {}
        self._copy_stream = None
        # Each offloaded parameter's version counter when its host copy last matched it (see _refresh_host_params).
        self._synced_version: Dict[torch.Tensor, int] = {}

    @property
    def optimizer_class(self) -> Type[torch.optim.Optimizer]:
        """The class of the device part (the kind of state every parameter has; a partial is unwrapped)."""
        return getattr(self.gpu_optimizer_cls, "func", self.gpu_optimizer_cls)

    @property
    def _grad_attribute(self) -> str:
        """Where the parameters' gradients are: ``decoupled_grad`` for sub-optimizers that read it there (the
        precision-aware optimizer's, whose main gradient may have another dtype than its parameter)."""
        return "decoupled_grad" if getattr(self.sub_optimizers[0], "use_decoupled_grad", False) else "grad"

    def init_state(self, init_state_fn=None) -> List[torch.optim.Optimizer]:
        """Build the sub-optimizers (once) and let ``init_state_fn(sub_optimizer)`` create their empty state;
        returns the sub-optimizers (host part first)."""
        if self.sub_optimizers is None:
            self._build_sub_optimizers()
        if init_state_fn is not None:
            for optimizer in self.sub_optimizers:
                init_state_fn(optimizer)
        self._link_states()
        return self.sub_optimizers

    def _build_sub_optimizers(self) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        budget = self.offload_fraction * sum(p.numel() for p in params)
        offloaded_numel, host_groups, device_groups = 0, [], []
        for group in self.param_groups:
            settings = {key: value for key, value in group.items() if key != "params"}
            host_params, device_params = [], []
            for param in group["params"]:
                # A parameter is offloaded whole or not at all; a later, smaller one may still fit.
                if offloaded_numel + param.numel() <= budget:
                    offloaded_numel += param.numel()
                    host_params.append(self._offload(param))
                else:
                    device_params.append(param)
            host_groups.append({**settings, "params": host_params})
            device_groups.append({**settings, "params": device_params})
        self.offloaded_numel = offloaded_numel
        cpu_optimizer = self.cpu_optimizer_cls(host_groups, **self.defaults)
        gpu_optimizer = self.gpu_optimizer_cls(device_groups, **self.defaults)
        self.sub_optimizers = [cpu_optimizer, gpu_optimizer]
        for param, host_param, _ in self.offloaded:
            self._owner[param] = (cpu_optimizer, host_param)
        for group in device_groups:
            for param in group["params"]:
                self._owner[param] = (gpu_optimizer, param)
        if self.overlap_cpu_optimizer_d2h_h2d:
            self._copy_stream = side_stream()

    def _offload(self, param: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.param_update_in_fp32 and param.is_floating_point() else param.dtype
        host_param = host_buffer_like(param, self.pin_cpu_params, dtype)
        host_param.copy_(param.detach())
        host_grad = host_buffer_like(host_param, self.pin_cpu_grads)
        self.offloaded.append((param, host_param, host_grad))
        self._synced_version[param] = param._version
        return host_param

    def _refresh_host_params(self) -> None:
        """Copy a parameter to its host copy when something else wrote it since the last step (a checkpoint
        load, a wrapper reloading main params): torch bumps a tensor's version counter, shared with its views, at
        every in-place write."""
        for param, host_param, _ in self.offloaded:
            if param._version != self._synced_version[param]:
                host_param.copy_(param.detach())
                self._synced_version[param] = param._version

    def _link_states(self) -> None:
        """Make ``self.state[param]`` and the owning sub-optimizer's state the same dict, its tensors on that
        side's device (after a load, or a wrapper's reset, replaced one of them)."""
        for param, (optimizer, stepped) in self._owner.items():
            mine, theirs = self.state.get(param), optimizer.state.get(stepped)
            if mine is theirs and mine is not None:
                continue
            state = mine if mine else (theirs or {})
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[name] = value.to(stepped.device)
                elif isinstance(value, torch.Tensor) and name == "step":
                    # Fused kernels keep the step counter with the parameter, the others on the host.
                    fused = optimizer.defaults.get("fused")
                    state[name] = value.to(stepped.device if fused else "cpu")
            optimizer.state[stepped] = state
            self.state[param] = state

    def _sync_hyperparameters(self) -> None:
        # The scheduler writes lr and weight_decay into this optimizer's groups; the sub-groups follow them.
        for index, group in enumerate(self.param_groups):
            for optimizer in self.sub_optimizers:
                optimizer.param_groups[index].update({k: v for k, v in group.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        """Copy the offloaded gradients to the host, step both parts and copy the offloaded parameters back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.init_state()
        self._sync_hyperparameters()
        self._refresh_host_params()
        with stream_context(self._copy_stream):
            wait_stream(self._copy_stream, None)  # the gradients are complete on the current stream
            grad_attribute = self._grad_attribute
            for param, host_param, host_grad in self.offloaded:
                grad = getattr(param, grad_attribute, None)
                # A lower-precision gradient is widened into the host buffer (exactly).
                if grad is not None:
                    host_grad.copy_(grad, non_blocking=True)
                setattr(host_param, grad_attribute, None if grad is None else host_grad)
        cpu_optimizer, gpu_optimizer = self.sub_optimizers
        gpu_optimizer.step()  # overlaps the gradient copies when they run on the side stream
        if self._copy_stream is not None:
            self._copy_stream.synchronize()  # the host step reads the copied gradients
        cpu_optimizer.step()
        with stream_context(self._copy_stream):
            for param, host_param, _ in self.offloaded:
                param.detach().copy_(host_param, non_blocking=True)
                self._synced_version[param] = param._version
        wait_stream(None, self._copy_stream)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        for _, host_param, _ in self.offloaded:
            host_param.grad = None
            host_param.decoupled_grad = None

    def load_state_dict(self, state_dict):
        """torch's load, then each parameter's state moved to the side that steps it."""
        super().load_state_dict(state_dict)
        if self.sub_optimizers is not None:
            self._link_states()

    def host_state_bytes(self) -> int:
        """Bytes this optimizer keeps in host memory: the host parameter copies, gradient buffers and state."""
        total = 0
        for _, host_param, host_grad in self.offloaded:
            total += host_param.numel() * host_param.element_size() + host_grad.numel() * host_grad.element_size()
            for value in self.sub_optimizers[0].state.get(host_param, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total
