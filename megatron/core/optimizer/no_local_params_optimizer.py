"""The expert optimizer of a rank whose pipeline stage holds no expert parameters, in a model that has some.

With ``moe_layer_freq`` (e.g. DeepSeek's first dense layers) a pipeline stage can hold only dense layers while the
other stages hold MoE layers. The expert optimizer's gradient statistics are collectives over the expert-TP x EP x
PP group (or every rank, with the distributed optimizer), which spans the stages: a rank without expert parameters
must still join them, with nothing to contribute, or the ranks that have experts wait forever. This optimizer holds
no parameters and issues exactly the collectives a real expert optimizer issues in a step (the overflow check when
there is a grad scaler, the gradient norm, the zero count, the grad-norm-group query).
"""

from types import SimpleNamespace
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import OptimizerConfig
from megatron.core.utils import get_current_device


class NoLocalParamsOptimizer(MegatronOptimizer):
    """Stands in for the expert optimizer on a rank without expert parameters (see the module docstring)."""

    def __init__(self, config: OptimizerConfig, has_grad_scaler: bool):
        super().__init__(SimpleNamespace(param_groups=[], state={}), config)
        self.has_grad_scaler = has_grad_scaler

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        if not self.has_grad_scaler:
            return False
        found_inf = torch.zeros(1, dtype=torch.float32, device=get_current_device())
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=self.get_grad_stats_parallel_group())
        return found_inf.item() > 0

    def step_with_ready_grads(self) -> bool:
        return True

    def zero_grad(self, set_to_none: bool = True):
        pass

    def reload_model_params(self, state_dict=None):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass

    def sharded_state_dict(
        self, model_sharded_state_dict: Dict[str, Any], is_loading: bool = False, metadata: Optional[dict] = None
    ) -> Dict[str, Any]:
        return {}
