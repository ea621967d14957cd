"""FP8 recipes as data, the region they are active in, and the delayed-scaling state a linear layer keeps.

A :class:`Fp8ScalingRecipe` says how the operands of a linear layer's three GEMMs (forward, input gradient, weight
gradient) are quantised: the format (``e4m3`` everywhere, or ``hybrid``: E4M3 forward, E5M2 gradients), the scaling
recipe (``tensorwise``, ``delayed``, ``mxfp8``, ``blockwise``), delayed scaling's margin and amax history, and
whether the weight-gradient GEMM runs in FP8 at all (``fp8_wgrad``).

:func:`fp8_autocast` makes a recipe active for the linear layers called inside it (Transformer Engine's
``fp8_autocast``, which Megatron's ``get_fp8_context`` enters around each transformer layer); layers called outside
run in their parameters' precision. Backward uses the recipe its forward saw.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, Optional

import torch
import torch.distributed as dist

from megatron.core.fp8.quantization import E4M3, E5M2, QuantizedTensor, amax_to_scale, quantize_with_scale

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
RECIPE_BLOCK_SIZES = {"mxfp8": 32, "blockwise": 128}
"""Recipes whose scales cover blocks along a GEMM dimension: every linear dimension must be a multiple of it."""


@dataclass(frozen=True)
class Fp8ScalingRecipe:
    """How FP8 linear layers quantise (see the module docstring); field names follow TransformerConfig's."""

    fp8_format: str = "hybrid"
    recipe: str = "tensorwise"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True

    def __post_init__(self):
        if self.fp8_format not in FP8_FORMATS:
            raise ValueError(f"fp8={self.fp8_format!r} is not an FP8 format; choose one of {FP8_FORMATS}")
        if self.recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe={self.recipe!r} is not supported yet; choose one of {FP8_RECIPES}")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"fp8_amax_compute_algo={self.amax_compute_algo!r} is not one of {AMAX_COMPUTE_ALGOS}")
        if self.amax_history_len < 1:
            raise ValueError(f"fp8_amax_history_len={self.amax_history_len} must be at least 1")

    @property
    def forward_dtype(self) -> torch.dtype:
        """The format of activations and weights."""
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        """The format of output gradients: E5M2 (wider range) under ``hybrid``."""
        return E5M2 if self.fp8_format == "hybrid" else E4M3

    @classmethod
    def from_config(cls, config) -> Optional["Fp8ScalingRecipe"]:
        """The recipe a TransformerConfig asks for, or None when ``config.fp8`` is unset."""
        if not getattr(config, "fp8", None):
            return None
        recipe = getattr(config.fp8_recipe, "value", config.fp8_recipe)
        return cls(
            fp8_format=config.fp8,
            recipe=recipe,
            margin=config.fp8_margin,
            amax_history_len=config.fp8_amax_history_len,
            amax_compute_algo=config.fp8_amax_compute_algo,
            fp8_wgrad=config.fp8_wgrad,
        )


@dataclass(frozen=True)
class _Fp8Region:
    recipe: Fp8ScalingRecipe
    amax_group: Optional[dist.ProcessGroup]


_active = threading.local()


@contextlib.contextmanager
def fp8_autocast(recipe: Fp8ScalingRecipe, amax_group: Optional[dist.ProcessGroup] = None) -> Iterator[None]:
    """Run the linear layers called inside in FP8 with ``recipe``; per-tensor amaxes are max-reduced over
    ``amax_group`` (None: each layer's tensor-parallel group), so every rank holding a piece of a tensor, or a
    replica of the layer, uses the same scale."""
    previous = getattr(_active, "region", None)
    _active.region = _Fp8Region(recipe, amax_group)
    try:
        yield
    finally:
        _active.region = previous


def active_fp8_region() -> Optional[_Fp8Region]:
    """The recipe and amax group of the innermost :func:`fp8_autocast`, or None outside one."""
    return getattr(_active, "region", None)


def reduce_amax(amax: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``amax`` max-reduced over ``group`` (nothing to do for one rank)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
"""Slots of a linear layer's delayed-scaling state (Transformer Engine's forward input, weight, backward gradient)."""


class DelayedScalingState:
    """A linear layer's amax history (``[amax_history_len, 3]``, the newest row first) and current scales
    (``[3]``) for its input, weight and output gradient.

    Each quantisation uses the scale derived from the history so far (1.0 before the first step), then records
    the tensor's amax (reduced over the amax group) and updates the scale from the history (its maximum, or its
    newest entry for ``most_recent``): ``fp8_max / amax / 2**margin``. Saved in checkpoints through the layer's
    extra state.
    """

    def __init__(self, amax_history_len: int):
        self.amax_history = torch.zeros(amax_history_len, 3, dtype=torch.float32)
        self.scale = torch.ones(3, dtype=torch.float32)

    def _to(self, device: torch.device) -> None:
        if self.scale.device != device:
            self.amax_history, self.scale = self.amax_history.to(device), self.scale.to(device)

    @torch.no_grad()
    def _record(self, slot: int, amax: torch.Tensor, fp8_dtype: torch.dtype, recipe: Fp8ScalingRecipe) -> None:
        history = torch.roll(self.amax_history[:, slot], 1)
        history[0] = amax
        self.amax_history[:, slot] = history
        window = history.amax() if recipe.amax_compute_algo == "max" else history[0]
        # A zero or non-finite amax leaves the scale as it was, as Transformer Engine does.
        usable = torch.isfinite(window) & (window > 0)
        new_scale = amax_to_scale(window, fp8_dtype, recipe.margin)
        self.scale[slot] = torch.where(usable, new_scale, self.scale[slot])

    def quantize(
        self, slot: int, x: torch.Tensor, fp8_dtype: torch.dtype, recipe: Fp8ScalingRecipe, group
    ) -> QuantizedTensor:
        self._to(x.device)
        amax = reduce_amax(x.detach().abs().amax().to(torch.float32), group)
        quantized = quantize_with_scale(x, self.scale[slot].clone(), fp8_dtype)
        self._record(slot, amax, fp8_dtype, recipe)
        return quantized

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {"fp8_amax_history": self.amax_history.cpu().clone(), "fp8_scale": self.scale.cpu().clone()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        history, scale = state["fp8_amax_history"], state["fp8_scale"]
        if history.shape != self.amax_history.shape or scale.shape != self.scale.shape:
            raise ValueError(
                f"delayed-scaling state of shape {tuple(history.shape)} does not fit this layer's "
                f"{tuple(self.amax_history.shape)}: the checkpoint was written with another fp8_amax_history_len"
            )
        device = self.scale.device
        self.amax_history, self.scale = history.to(device, torch.float32), scale.to(device, torch.float32)


def delayed_scaling_state_for(config) -> Optional[DelayedScalingState]:
    """A fresh delayed-scaling state for a linear layer built with ``config``, when it asks for the delayed recipe
    (built with the layer, so a checkpoint's state can be loaded before the first step), else None."""
    recipe = Fp8ScalingRecipe.from_config(config)
    if recipe is None or recipe.recipe != "delayed":
        return None
    return DelayedScalingState(recipe.amax_history_len)
