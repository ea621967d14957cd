"""OptimizerConfig (the optimizer, its hyper-parameters, mixed precision and loss scaling) and ParamKey, which
selects the parameters a per-group override applies to (Megatron's fields and names)."""

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple, Union

import torch

# Muon orthogonalises the 2-D weights; "dist_muon" is Muon under the layer-wise distributed optimizer.
MUON_OPTIMIZERS = ("muon", "dist_muon")
SUPPORTED_OPTIMIZERS = ("adam", "sgd", "lion") + MUON_OPTIMIZERS
# Megatron-LM's other --optimizer choices: optimizers from the emerging-optimizers package, not built here.
_EMERGING_OPTIMIZERS = ("soap", "adaptive_muon")
MUON_SCALAR_OPTIMIZERS = ("adam", "lion")
MUON_COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "aol")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
MUON_FP32_MATMUL_PRECISIONS = ("low", "medium", "high")
# Megatron-LM's command line spells these dtypes as strings.
_DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ParamPredicate:
    """A named, hashable test of a parameter, for :class:`ParamKey`; two predicates with the same ``name`` are
    the same key (``fn`` is not compared)."""

    name: str
    fn: Callable[[torch.nn.Parameter], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter) -> bool:
        return self.fn(param)


@dataclass(frozen=True)
class ParamWithNamePredicate:
    """Like :class:`ParamPredicate`, but ``fn(param, name)`` also sees the parameter's name in its module."""

    name: str
    fn: Callable[[torch.nn.Parameter, str], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter, name: str) -> bool:
        return self.fn(param, name)


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


@dataclass(frozen=True)
class ParamKey:
    """Selects parameters for a :class:`~megatron.core.optimizer_param_scheduler.ParamGroupOverride` in
    ``get_megatron_optimizer(config_overrides={ParamKey(...): override})``.

    A parameter matches when any criterion matches: a ``name`` glob (fnmatch syntax, e.g. ``"*.bias"``) matches its
    name, it has a truthy attribute named in ``attr``, or any ``predicate`` / ``with_name_predicate`` accepts it.
    Each field is one value or a tuple of them.
    """

    name: Union[str, Tuple[str, ...]] = field(default_factory=tuple)
    """Parameter-name glob(s)."""
    attr: Union[str, Tuple[str, ...]] = field(default_factory=tuple)
    """Parameter attribute(s), e.g. ``is_embedding_or_output_parameter``."""
    predicate: Union[ParamPredicate, Tuple[ParamPredicate, ...]] = field(default_factory=tuple)
    """Predicate(s) on the parameter."""
    with_name_predicate: Union[ParamWithNamePredicate, Tuple[ParamWithNamePredicate, ...]] = field(
        default_factory=tuple
    )
    """Predicate(s) on the parameter and its name."""

    def matches(self, param: torch.nn.Parameter, param_name: str) -> bool:
        """Whether ``param`` (called ``param_name`` in its module) is selected by this key."""
        return (
            any(fnmatch.fnmatch(param_name, pattern) for pattern in _as_tuple(self.name))
            or any(getattr(param, attr, False) for attr in _as_tuple(self.attr))
            or any(predicate(param) for predicate in _as_tuple(self.predicate))
            or any(predicate(param, param_name) for predicate in _as_tuple(self.with_name_predicate))
        )


def _not_supported(feature: str, name: str, value) -> ValueError:
    return ValueError(f"OptimizerConfig: not supported yet: {feature} ({name}={value!r}); leave it at its default")


@dataclass
class OptimizerConfig:
    """Settings read by :func:`megatron.core.optimizer.get_megatron_optimizer`.

    Fields of features not built here (fp8 parameter gathers, the Lion/SOAP/adaptive-Muon optimizers, CUDA graphs)
    are accepted at their defaults and refused otherwise. The layer-wise distributed optimizer is built for Muon only
    (``optimizer='dist_muon'``). Hyper-parameters of an optimizer that is not selected (``muon_*``, ``lion_*``,
    ``soap_*``, the offload fraction and pinning without CPU offload, ``store_param_remainders``) are inert, as in
    Megatron.
    """

    # ---- general ----
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
    apply_wd_to_qk_layernorm: bool = False
    """Decay the q/k layernorm weights too (the other 1-D parameters and biases still get none)."""

    # ---- precision ----
    fp8_recipe: Optional[str] = None
    """How the distributed optimizer treats fp8 parameters; inert here, as fp8 parameters are not built."""
    fp16: bool = False
    """The model runs in float16: keep fp32 main parameters and use (dynamic) loss scaling."""
    bf16: bool = False
    """The model runs in bfloat16: keep fp32 main parameters."""
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """Reuse the gradient buffer for mxfp8 parameter all-gathers (not supported yet: must be False)."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of the model's parameters."""
    use_precision_aware_optimizer: bool = False
    """Store the distributed optimizer's main params, main grads and Adam moments in the dtypes below, computing
    the update in fp32 (Adam with use_distributed_optimizer only)."""
    store_param_remainders: bool = True
    """Megatron's TE kernel stores only the remainder bits of fp32 main params of bf16 parameters; inert here (the
    main params are stored whole in main_params_dtype)."""
    main_grads_dtype: torch.dtype = torch.float32
    """Precision-aware optimizer: dtype of the main gradients (fp32 or bf16)."""
    main_params_dtype: torch.dtype = torch.float32
    """Precision-aware optimizer: dtype of the main parameters (fp32, or fp16 for a bf16/fp16 model)."""
    exp_avg_dtype: torch.dtype = torch.float32
    """Precision-aware optimizer: dtype of Adam's first moment (fp32, bf16, fp16; torch.uint8 is Megatron's fp8)."""
    exp_avg_sq_dtype: torch.dtype = torch.float32
    """Precision-aware optimizer: dtype of Adam's second moment (as exp_avg_dtype)."""
    optimizer: str = "adam"
    """'adam' (AdamW-style decoupled weight decay by default), 'sgd', 'lion' (sign of interpolated momentum,
    ``lion_beta1`` / ``lion_beta2``), 'muon' (Newton-Schulz orthogonalised momentum for 2-D weights,
    ``muon_scalar_optimizer`` for the rest) or 'dist_muon' (Muon under the layer-wise distributed optimizer)."""

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

    # ---- emerging optimizers (not built: only read when optimizer names one) ----
    muon_momentum: float = 0.95
    """Muon: momentum of the internal SGD."""
    muon_split_qkv: bool = True
    """Muon: orthogonalise q, k and v separately."""
    muon_nesterov: bool = False
    """Muon: Nesterov momentum."""
    muon_scale_mode: str = "spectral"
    """Muon: scale factor of the update."""
    muon_fp32_matmul_prec: str = "medium"
    """Muon: fp32 matmul precision of the Newton-Schulz iteration."""
    muon_coefficient_type: str = "quintic"
    """Muon: Newton-Schulz coefficients."""
    muon_num_ns_steps: int = 5
    """Muon: Newton-Schulz iterations."""
    muon_tp_mode: str = "blockwise"
    """Muon: how tensor-parallel weights are orthogonalised."""
    muon_extra_scale_factor: float = 1.0
    """Muon: extra scale of the update."""
    muon_scalar_optimizer: str = "adam"
    """Muon: optimizer of the non-matrix parameters ('adam' or 'lion')."""
    lion_beta1: float = 0.95
    """Lion: beta of the sign update."""
    lion_beta2: float = 0.98
    """Lion: beta of the momentum."""
    soap_shampoo_beta: float = 0.95
    """SOAP: beta of the Shampoo preconditioner."""
    soap_precondition_frequency: int = 1
    """SOAP: steps between preconditioner updates."""
    soap_use_kl_shampoo: bool = True
    """SOAP: KL-Shampoo preconditioner."""
    adaptive_muon_moment2_method: str = "adamuon"
    """Adaptive Muon: second-moment method."""
    adaptive_muon_beta2: float = 0.95
    """Adaptive Muon: second-moment decay."""
    adaptive_muon_eps: float = 1e-08
    """Adaptive Muon: epsilon."""

    # ---- distributed optimizer ----
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over data-parallel ranks (ZeRO-1); the model must be wrapped in DDP with the same."""
    use_layer_wise_distributed_optimizer: bool = False
    """Shard Muon layer by layer: each parameter is stepped whole on one data-parallel rank, then broadcast
    (optimizer='dist_muon' implies it; only Muon supports it)."""
    overlap_param_gather: bool = False
    """All-gather updated parameters during the next forward (mirror of the DDP config's field)."""
    overlap_param_gather_with_optimizer_step: bool = False
    """Overlap the first parameter all-gather with the optimizer step (not supported yet: must be False)."""

    # ---- CPU offload (HybridDeviceOptimizer; on a CPU-only machine both sides are host memory) ----
    optimizer_cpu_offload: bool = False
    """Keep a fraction of the parameters' optimizer state, and their step, on the host."""
    optimizer_offload_fraction: float = 0.0
    """Fraction (by element count, in [0, 1]) of the parameters whose optimizer state lives on the host."""
    use_torch_optimizer_for_cpu_offload: bool = False
    """Step the host part with torch's per-tensor (foreach) kernel instead of its fused one."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Overlap the host step with its device-to-host and host-to-device copies (CUDA streams; no effect on CPU)."""
    pin_cpu_grads: bool = True
    """Pin offloaded gradients (read only with optimizer_cpu_offload)."""
    pin_cpu_params: bool = True
    """Pin offloaded parameters (read only with optimizer_cpu_offload)."""

    # ---- miscellaneous ----
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0: no clipping)."""
    grad_norm_skip_threshold: float = float("inf")
    """Skip the step (step() reports update_successful=False) when the global gradient norm exceeds this."""
    log_num_zeros_in_grad: bool = False
    """Count zero entries of the gradient at each step (step() returns the count)."""
    barrier_with_L1_time: bool = False
    """Timers: add barriers around level-1 timings."""
    timers: Optional[Callable] = None
    """Megatron Timers object, if the caller wants per-phase timings."""
    config_logger_dir: str = ""
    """Directory to dump configs to (unused here)."""
    optimizer_cuda_graph: bool = False
    """Capture the optimizer step in a CUDA graph (not supported yet: must be False)."""

    def __post_init__(self):
        for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype", "params_dtype"):
            value = getattr(self, name)
            if isinstance(value, str) and value in _DTYPE_NAMES:
                setattr(self, name, _DTYPE_NAMES[value])
        _check_optimizer_choice(self)
        _check_features_not_built(self)
        _check_muon(self)
        _check_precision_aware(self)
        _check_cpu_offload(self)
        _check_values(self)


def _check_optimizer_choice(config: OptimizerConfig) -> None:
    if config.optimizer in _EMERGING_OPTIMIZERS:
        raise _not_supported(f"the {config.optimizer} optimizer", "optimizer", config.optimizer)
    if config.optimizer not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"OptimizerConfig.optimizer={config.optimizer!r} is not supported; use one of {SUPPORTED_OPTIMIZERS}"
        )


_FEATURES_NOT_BUILT = (
    ("reuse_grad_buf_for_mxfp8_param_ag", "mxfp8 parameter all-gather in the gradient buffer"),
    ("overlap_param_gather_with_optimizer_step", "overlapping the parameter all-gather with the optimizer step"),
    ("optimizer_cuda_graph", "CUDA graph of the optimizer step"),
)


def _check_features_not_built(config: OptimizerConfig) -> None:
    for name, feature in _FEATURES_NOT_BUILT:
        if getattr(config, name):
            raise _not_supported(feature, name, getattr(config, name))


# Megatron's choices for each storage dtype (--main-params-dtype, ...); torch.uint8 stands for fp8.
_STATE_DTYPE_CHOICES = {
    "main_params_dtype": (torch.float32, torch.float16),
    "main_grads_dtype": (torch.float32, torch.bfloat16),
    "exp_avg_dtype": (torch.float32, torch.float16, torch.bfloat16, torch.uint8),
    "exp_avg_sq_dtype": (torch.float32, torch.float16, torch.bfloat16, torch.uint8),
}


def _check_precision_aware(config: OptimizerConfig) -> None:
    lowered = [name for name in _STATE_DTYPE_CHOICES if getattr(config, name) != torch.float32]
    for name, choices in _STATE_DTYPE_CHOICES.items():
        if getattr(config, name) not in choices:
            raise ValueError(f"OptimizerConfig.{name}={getattr(config, name)} is not one of {choices}")
    if not config.use_precision_aware_optimizer:
        if lowered:
            raise ValueError(
                f"OptimizerConfig.{lowered[0]}={getattr(config, lowered[0])} needs "
                "use_precision_aware_optimizer=True (the plain optimizer keeps its state in fp32)"
            )
        return
    if config.optimizer != "adam":
        raise ValueError(
            f"OptimizerConfig.use_precision_aware_optimizer=True needs optimizer='adam', got {config.optimizer!r}"
        )
    if not config.use_distributed_optimizer:
        raise ValueError(
            "OptimizerConfig.use_precision_aware_optimizer=True needs use_distributed_optimizer=True (it stores the "
            "distributed optimizer's shards); set both"
        )
    if config.main_params_dtype != torch.float32 and not (config.bf16 or config.fp16):
        raise ValueError(
            f"OptimizerConfig.main_params_dtype={config.main_params_dtype} needs a bf16 or fp16 model: an fp32 "
            "model's parameters are their own main parameters; set bf16=True or leave main_params_dtype at fp32"
        )
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(config, name) == torch.uint8:
            if config.fp8_recipe is None:
                raise ValueError(
                    f"OptimizerConfig.{name}=fp8 (torch.uint8) needs an fp8 scaling recipe (fp8_recipe); set it, "
                    "or store the moments in bf16"
                )
            raise _not_supported("fp8 Adam moments (scaled by the fp8 recipe)", name, "fp8")


def _check_cpu_offload(config: OptimizerConfig) -> None:
    if config.optimizer_cpu_offload and config.optimizer not in ("adam", "sgd"):
        raise ValueError(
            f"OptimizerConfig.optimizer_cpu_offload=True runs Adam or SGD on each side of the offload, not "
            f"optimizer={config.optimizer!r}; use optimizer='adam' or optimizer='sgd', or set "
            "optimizer_cpu_offload=False"
        )
    if not 0.0 <= config.optimizer_offload_fraction <= 1.0:
        raise ValueError(
            f"OptimizerConfig.optimizer_offload_fraction={config.optimizer_offload_fraction} is outside [0, 1]; "
            "give the fraction of the optimizer state to keep on the host (1.0: all of it)"
        )


# Newton-Schulz step counts each coefficient schedule accepts (a schedule of n sets runs whole cycles, except
# Polar Express, which runs its 8 sets once and repeats the last).
_NS_STEPS_RULE = {"quintic": 5, "aol": 4}


def _check_muon(config: OptimizerConfig) -> None:
    if config.optimizer not in MUON_OPTIMIZERS:
        if config.use_layer_wise_distributed_optimizer:
            raise ValueError(
                f"OptimizerConfig.use_layer_wise_distributed_optimizer=True needs optimizer='muon' or 'dist_muon', "
                f"got optimizer={config.optimizer!r}; use use_distributed_optimizer for Adam/SGD"
            )
        return
    choices = (
        ("muon_coefficient_type", MUON_COEFFICIENT_TYPES),
        ("muon_scale_mode", MUON_SCALE_MODES),
        ("muon_tp_mode", MUON_TP_MODES),
        ("muon_fp32_matmul_prec", MUON_FP32_MATMUL_PRECISIONS),
    )
    for name, allowed in choices:
        if getattr(config, name) not in allowed:
            raise ValueError(f"OptimizerConfig.{name}={getattr(config, name)!r} is not one of {allowed}")
    if config.muon_scalar_optimizer not in MUON_SCALAR_OPTIMIZERS:
        raise ValueError(
            f"OptimizerConfig.muon_scalar_optimizer={config.muon_scalar_optimizer!r} is not one of "
            f"{MUON_SCALAR_OPTIMIZERS}"
        )
    steps, coefficients = config.muon_num_ns_steps, config.muon_coefficient_type
    cycle = _NS_STEPS_RULE.get(coefficients)
    if steps < 1 or (cycle is not None and steps % cycle) or (coefficients == "polar_express" and steps < 8):
        need = {"quintic": "a multiple of 5", "aol": "a multiple of 4", "polar_express": "at least 8"}
        raise ValueError(
            f"OptimizerConfig.muon_num_ns_steps={steps} does not fit muon_coefficient_type={coefficients!r}: it "
            f"must be {need.get(coefficients, 'at least 1')}"
        )
    if not 0.0 <= config.muon_momentum < 1.0:
        raise ValueError(f"OptimizerConfig.muon_momentum must be in [0, 1), got {config.muon_momentum}")
    if config.fp16:
        raise ValueError(
            f"OptimizerConfig: optimizer={config.optimizer!r} does not support fp16 (Newton-Schulz has no loss "
            "scaling); use bf16 or fp32"
        )
    if config.use_distributed_optimizer:
        fix = (
            "unset use_distributed_optimizer (dist_muon shards its state layer by layer already)"
            if config.optimizer == "dist_muon"
            else "use optimizer='dist_muon' (the layer-wise distributed optimizer) instead"
        )
        raise ValueError(
            f"OptimizerConfig: optimizer={config.optimizer!r} cannot shard its state with "
            f"use_distributed_optimizer=True (Newton-Schulz needs whole matrices); {fix}"
        )


def _check_values(config: OptimizerConfig) -> None:
    if config.fp16 and config.bf16:
        raise ValueError("OptimizerConfig: fp16 and bf16 are both set; choose one")
    if config.lr is not None and config.min_lr is not None and config.min_lr > config.lr:
        raise ValueError(f"OptimizerConfig: min_lr={config.min_lr} is larger than lr={config.lr}; lower min_lr")
    if config.clip_grad < 0:
        raise ValueError(f"OptimizerConfig.clip_grad must be >= 0 (0 disables clipping), got {config.clip_grad}")
    if not config.grad_norm_skip_threshold > 0:
        raise ValueError(
            "OptimizerConfig.grad_norm_skip_threshold must be positive (inf: never skip), got "
            f"{config.grad_norm_skip_threshold}"
        )
    if config.loss_scale is not None and config.loss_scale <= 0:
        raise ValueError(f"OptimizerConfig.loss_scale must be positive or None, got {config.loss_scale}")
    if config.hysteresis < 1:
        raise ValueError(f"OptimizerConfig.hysteresis must be >= 1, got {config.hysteresis}")


@dataclass
class AdamOptimizerConfig(OptimizerConfig):
    """An OptimizerConfig for Adam (Megatron's name; the same fields)."""

    def __post_init__(self):
        if self.optimizer != "adam":
            raise ValueError(f"AdamOptimizerConfig.optimizer must be 'adam', got {self.optimizer!r}")
        super().__post_init__()


@dataclass
class SGDOptimizerConfig(OptimizerConfig):
    """An OptimizerConfig for SGD with momentum (Megatron's name; the same fields): it always builds SGD."""

    def __post_init__(self):
        # The inherited default names Adam; a config of this class means SGD.
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"SGDOptimizerConfig.optimizer must be 'sgd', got {self.optimizer!r}")
        self.optimizer = "sgd"
        super().__post_init__()
