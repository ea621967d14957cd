"""Loss scalers for fp16 training: a constant scale, or a dynamic one that backs off on overflow and grows back.

The optimizer multiplies the loss by ``scale`` before backward, divides the gradients by it (``inv_scale``) before
the step, and calls ``update(found_inf)``; a step whose gradients overflowed is skipped.
"""

from abc import ABC, abstractmethod
from typing import Dict

import torch

from megatron.core.utils import get_current_device


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor([float(value)], dtype=torch.float32, device=get_current_device())


class MegatronGradScaler(ABC):
    """A loss scale held as a one-element fp32 tensor."""

    def __init__(self, initial_scale: float):
        if initial_scale <= 0.0:
            raise ValueError(f"initial loss scale must be positive, got {initial_scale}")
        self._scale = _scalar(initial_scale)

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step whose gradients did (``found_inf``) or did not overflow."""

    @abstractmethod
    def state_dict(self) -> Dict:
        pass

    @abstractmethod
    def load_state_dict(self, state_dict: Dict) -> None:
        pass


class ConstantGradScaler(MegatronGradScaler):
    """A loss scale that never changes (``--loss-scale``)."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> Dict:
        return {}

    def load_state_dict(self, state_dict: Dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scaling.

    On overflow: the growth count restarts and the hysteresis budget drops by one; once it is used up the scale is
    multiplied by ``backoff_factor`` (never below ``min_scale``). After ``growth_interval`` overflow-free steps in a
    row the scale is multiplied by ``growth_factor`` and the hysteresis budget is refilled.
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float,
        backoff_factor: float,
        growth_interval: int,
        hysteresis: int,
    ):
        super().__init__(initial_scale)
        if min_scale <= 0.0 or min_scale > initial_scale:
            raise ValueError(
                f"min loss scale must be positive and at most the initial scale {initial_scale}, got {min_scale}"
            )
        if growth_factor <= 1.0:
            raise ValueError(f"loss scale growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"loss scale backoff factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0:
            raise ValueError(f"loss scale window (growth interval) must be positive, got {growth_interval}")
        if hysteresis <= 0:
            raise ValueError(f"loss scale hysteresis must be positive, got {hysteresis}")
        self.min_scale = _scalar(min_scale)
        self.growth_factor = _scalar(growth_factor)
        self.backoff_factor = _scalar(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> Dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Dict) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing:
            raise KeyError(f"DynamicGradScaler state dict lacks {sorted(missing)}; it has {sorted(state_dict)}")
        self._scale = state_dict["scale"].detach().to(device=get_current_device(), dtype=torch.float32).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
