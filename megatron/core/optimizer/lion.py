"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): each step moves every weight by the same
amount, ``lr``, in the direction of the sign of an interpolation between its momentum and its gradient, with
decoupled weight decay. One state tensor per parameter (``exp_avg``, the momentum): half of Adam's optimizer state.

    update = sign(beta1 * m + (1 - beta1) * g)
    p      = p * (1 - lr * weight_decay) - lr * update
    m      = beta2 * m + (1 - beta2) * g

``--optimizer lion`` (with ``--lion-beta1`` / ``--lion-beta2``, Megatron's defaults 0.95 / 0.98) and
``--muon-scalar-optimizer lion`` build this class. Megatron-Core 0.19 takes its Lion from the optional
emerging-optimizers package; the update above is the published one, written here so that nothing else is needed.
Because the update has unit size per element, Lion wants a learning rate 3-10x smaller than AdamW's and a
proportionally larger weight decay (the paper's advice).
"""

from typing import Iterable, Tuple

import torch


class Lion(torch.optim.Optimizer):
    """The Lion optimizer; ``betas`` are (interpolation, momentum decay), Megatron's ``lion_beta1`` / ``lion_beta2``."""

    def __init__(
        self, params: Iterable, lr: float = 1e-4, betas: Tuple[float, float] = (0.95, 0.98), weight_decay: float = 0.0
    ):
        if lr < 0.0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        for name, beta in zip(("lion_beta1", "lion_beta2"), betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Lion: {name} must be in [0, 1), got {beta}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, weight_decay = group["lr"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                momentum = state["exp_avg"]
                update = momentum.lerp(grad, 1.0 - beta1).sign_()
                if weight_decay != 0.0:
                    param.mul_(1.0 - lr * weight_decay)
                param.add_(update, alpha=-lr)
                momentum.lerp_(grad, 1.0 - beta2)
        return loss
