"""Adam whose main parameters, main gradients and moments are stored below fp32, with the update computed in fp32.

Megatron's precision-aware optimizer (``OptimizerConfig.use_precision_aware_optimizer``) hands the distributed
optimizer's shards to Transformer Engine's ``FusedAdam`` with ``master_weight_dtype`` / ``exp_avg_dtype`` /
``exp_avg_sq_dtype`` and ``use_decoupled_grad=True``: each kernel loads the stored values, widens them to fp32,
applies Adam and rounds the results back to their storage dtypes. :class:`PrecisionAwareAdam` does the same with
torch's own Adam kernel (the fused one wherever the plain optimizer uses it): it widens one parameter at a time
into fp32 scratch tensors, runs ``torch.optim.adam.adam`` on them, and rounds the results back. With every dtype at
fp32 nothing is widened or rounded and the step is the plain optimizer's, bit for bit.

The gradient is read from ``param.decoupled_grad`` (Megatron's attribute for a main gradient whose dtype differs
from its parameter's, which ``param.grad`` may not hold), or ``param.grad`` with ``use_decoupled_grad=False``.
"""

from typing import Dict, Optional

import torch
from torch.optim.adam import adam

STATE_NAMES = ("exp_avg", "exp_avg_sq")


def _widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is fp32 (stepped in place), else an fp32 copy."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


class PrecisionAwareAdam(torch.optim.Adam):
    """``torch.optim.Adam`` (AdamW with ``decoupled_weight_decay=True``) storing Adam's moments in
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype``; the parameters it steps keep their own dtype (the distributed
    optimizer makes them ``main_params_dtype`` shards). Every other argument is torch's."""

    def __init__(
        self,
        params,
        *,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        **adam_kwargs,
    ):
        if adam_kwargs.get("amsgrad") or adam_kwargs.get("maximize"):
            raise ValueError("PrecisionAwareAdam: amsgrad and maximize are not supported; leave them False")
        super().__init__(params, **adam_kwargs)
        self.state_dtypes: Dict[str, torch.dtype] = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}
        self.use_decoupled_grad = use_decoupled_grad

    def grad_of(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient this optimizer steps ``param`` with."""
        if self.use_decoupled_grad:
            return getattr(param, "decoupled_grad", None)
        return param.grad

    def init_param_state(self, param: torch.Tensor, group: dict) -> None:
        """Zero moments in their storage dtypes and a zero step (on the device with fused kernels, as torch)."""
        state = self.state[param]
        if state:
            return
        step_device = param.device if group.get("fused") else torch.device("cpu")
        state["step"] = torch.zeros((), dtype=torch.float32, device=step_device)
        for name in STATE_NAMES:
            state[name] = torch.zeros(param.shape, dtype=self.state_dtypes[name], device=param.device)

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step of every parameter that has a gradient, computed in fp32."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                grad = self.grad_of(param)
                if grad is None:
                    continue
                self.init_param_state(param, group)
                state = self.state[param]
                work = [_widened(param), _widened(grad), *(_widened(state[name]) for name in STATE_NAMES)]
                # One parameter at a time: the fp32 scratch copies never exceed one parameter's size.
                adam(
                    [work[0]],
                    [work[1]],
                    [work[2]],
                    [work[3]],
                    [],
                    [state["step"]],
                    foreach=group["foreach"],
                    capturable=group["capturable"],
                    differentiable=group["differentiable"],
                    fused=group["fused"],
                    decoupled_weight_decay=group["decoupled_weight_decay"],
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                for stored, computed in zip((param, state["exp_avg"], state["exp_avg_sq"]), (work[0], *work[2:])):
                    if stored is not computed:
                        stored.copy_(computed)
        return loss

    def load_state_dict(self, state_dict):
        """torch's load casts every state tensor to its parameter's dtype; the moments go back to theirs (a
        lossless round trip for values that were stored in them)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name in STATE_NAMES:
                if name in state:
                    state[name] = state[name].to(self.state_dtypes[name])
