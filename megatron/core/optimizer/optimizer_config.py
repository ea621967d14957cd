"""OptimizerConfig: the optimizer, its hyper-parameters, mixed precision and loss scaling (Megatron's fields)."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

SUPPORTED_OPTIMIZERS = ("adam", "sgd")


@dataclass
class OptimizerConfig:
    """Settings read by :func:`megatron.core.optimizer.get_megatron_optimizer`."""

    # ---- general ----
    optimizer: str = "adam"
    """'adam' (AdamW-style decoupled weight decay by default) or 'sgd'."""
    lr: Optional[float] = None
    """Peak learning rate (the scheduler's max_lr); required."""
    min_lr: Optional[float] = None
    """Floor the learning-rate schedule decays to."""
    decoupled_lr: Optional[float] = None
    """Separate peak learning rate for the input embedding and output layer (None: use lr)."""
    decoupled_min_lr: Optional[float] = None
    """Separate minimum learning rate for the input embedding and output layer (None: use min_lr)."""
    weight_decay: float = 0.01
    """Weight decay coefficient (not applied to biases and 1-D parameters such as norms)."""

    # ---- precision ----
    fp16: bool = False
    """The model runs in float16: keep fp32 main parameters and use (dynamic) loss scaling."""
    bf16: bool = False
    """The model runs in bfloat16: keep fp32 main parameters."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of the model's parameters."""
    use_precision_aware_optimizer: bool = False
    """Keep main params / Adam moments in lower precision (needs TE's FusedAdam; not supported: must be False)."""
    main_grads_dtype: torch.dtype = torch.float32
    """Dtype of the main gradients (only fp32 is supported)."""
    main_params_dtype: torch.dtype = torch.float32
    """Dtype of the main parameters (only fp32 is supported)."""
    exp_avg_dtype: torch.dtype = torch.float32
    """Dtype of Adam's first moment (only fp32 is supported)."""
    exp_avg_sq_dtype: torch.dtype = torch.float32
    """Dtype of Adam's second moment (only fp32 is supported)."""

    # ---- loss scaling ----
    loss_scale: Optional[float] = None
    """Constant loss scale (None: dynamic scaling for fp16, none for bf16/fp32)."""
    initial_loss_scale: float = 2**32
    """Starting scale of dynamic loss scaling."""
    min_loss_scale: float = 1.0
    """Dynamic loss scaling never goes below this."""
    loss_scale_window: float = 1000
    """Successful steps between two doublings of the dynamic loss scale."""
    hysteresis: int = 2
    """Overflowing steps tolerated before the dynamic loss scale is halved."""

    # ---- Adam / SGD ----
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-08
    """Adam's denominator epsilon."""
    decoupled_weight_decay: bool = True
    """Decoupled weight decay (AdamW); False applies it as L2 in the gradient (Adam)."""
    sgd_momentum: float = 0.9
    """SGD momentum."""

    # ---- distributed optimizer ----
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (ZeRO-1); the model must be wrapped in DDP with the same."""
    overlap_param_gather: bool = False
    """All-gather updated parameters during the next forward (mirror of the DDP config's field)."""
    overlap_param_gather_with_optimizer_step: bool = False
    """Overlap the first parameter all-gather with the optimizer step (not supported: must be False)."""

    # ---- CPU offload (GPU feature) ----
    optimizer_cpu_offload: bool = False
    """Keep optimizer state on the host (not supported: must be False; on CPU it already is)."""
    optimizer_offload_fraction: float = 0.0
    """Fraction of the optimizer state to offload (with optimizer_cpu_offload)."""
    use_torch_optimizer_for_cpu_offload: bool = False
    """Use torch's optimizer for the offloaded part (with optimizer_cpu_offload)."""

    # ---- miscellaneous ----
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0: no clipping)."""
    log_num_zeros_in_grad: bool = False
    """Count zero entries of the gradient at each step (step() returns the count)."""
    barrier_with_L1_time: bool = False
    """Timers: add barriers around level-1 timings."""
    timers: Optional[Callable] = None
    """Megatron Timers object, if the caller wants per-phase timings."""
    config_logger_dir: str = ""
    """Directory to dump configs to (unused here)."""

    def __post_init__(self):
        if self.optimizer not in SUPPORTED_OPTIMIZERS:
            raise ValueError(
                f"OptimizerConfig.optimizer={self.optimizer!r} is not supported; use one of {SUPPORTED_OPTIMIZERS}"
            )
        if self.fp16 and self.bf16:
            raise ValueError("OptimizerConfig: fp16 and bf16 are both set; choose one")
        for name in (
            "use_precision_aware_optimizer",
            "overlap_param_gather_with_optimizer_step",
            "optimizer_cpu_offload",
        ):
            if getattr(self, name):
                raise ValueError(f"OptimizerConfig.{name}=True is not supported; leave it False")
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) != torch.float32:
                raise ValueError(
                    f"OptimizerConfig.{name}={getattr(self, name)} is not supported; only torch.float32 is"
                )
        if self.lr is not None and self.min_lr is not None and self.min_lr > self.lr:
            raise ValueError(f"OptimizerConfig: min_lr={self.min_lr} is larger than lr={self.lr}; lower min_lr")
        if self.clip_grad < 0:
            raise ValueError(f"OptimizerConfig.clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"OptimizerConfig.loss_scale must be positive or None, got {self.loss_scale}")
        if self.hysteresis < 1:
            raise ValueError(f"OptimizerConfig.hysteresis must be >= 1, got {self.hysteresis}")
