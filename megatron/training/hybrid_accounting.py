"""Former home of the hybrid-model arithmetic, kept importable: parameter counts now live in ``model_arithmetic``,
the hybrid FLOPs formula in ``flops`` and the activation bytes in ``theoretical_memory_usage``."""

from megatron.training.flops import (  # noqa: F401
    hybrid_floating_point_operations,
    mamba_layer_forward_flops,
    moe_layer_forward_flops,
)
from megatron.training.model_arithmetic import (  # noqa: F401
    MAMBA_CONV_WIDTH,
    MAMBA_EXPAND,
    MambaSizes,
    hybrid_layer_counts,
    mamba_sizes,
)
from megatron.training.model_arithmetic import hybrid_layer_parameters as layer_parameters  # noqa: F401
from megatron.training.model_arithmetic import moe_mlp_parameters as moe_layer_parameters  # noqa: F401
from megatron.training.theoretical_memory_usage import layer_activation_bytes  # noqa: F401
