"""Spec backends: which module implements each slot of a layer spec (linears, norms, core attention).

Layer-spec functions ask a backend for their building blocks, so one spec function serves several
implementations. :class:`LocalSpecProvider` gives this project's pure-PyTorch modules; :class:`TELayoutSpecProvider`
the same computations in Transformer Engine's checkpoint layout (fused norm + linear, ``_extra_state`` entries), which
the Transformer Engine layer specs build.
"""

from abc import ABC, abstractmethod
from typing import Optional

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.grouped_linear import ColumnParallelGroupedLinear, RowParallelGroupedLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.te_layout import (
    TELayoutColumnParallelGroupedLinear,
    TELayoutColumnParallelLinear,
    TELayoutDotProductAttention,
    TELayoutLayerNormColumnParallelLinear,
    TELayoutNorm,
    TELayoutRowParallelGroupedLinear,
    TELayoutRowParallelLinear,
)
from megatron.core.transformer.torch_norm import L2Norm, WrappedTorchNorm


class BackendSpecProvider(ABC):
    """The modules a layer spec is assembled from."""

    @abstractmethod
    def column_parallel_linear(self) -> type:
        """Linear split by output features (QKV, fc1)."""

    @abstractmethod
    def row_parallel_linear(self) -> type:
        """Linear split by input features (output projection, fc2)."""

    @abstractmethod
    def fuse_layernorm_and_linear(self) -> bool:
        """Whether the norm in front of a linear is fused into it (the layer then has no separate norm)."""

    @abstractmethod
    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        """The fused norm + column-parallel linear, when :meth:`fuse_layernorm_and_linear`."""

    @abstractmethod
    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """The norm module (``rms_norm`` selects RMSNorm where the module does not read the config)."""

    @abstractmethod
    def core_attention(self) -> type:
        """softmax(q k^T) v over this rank's heads."""

    @abstractmethod
    def activation_func(self) -> Optional[type]:
        """An activation module for the MLP, or None to apply ``config.activation_func``."""

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> ModuleSpec:
        """The routed experts: grouped linears (:class:`TEGroupedMLP`) with ``moe_use_grouped_gemm``, else one
        MLP per expert (:class:`SequentialMLP`) from this backend's linears."""
        if moe_use_grouped_gemm:
            fc1, fc2 = self._grouped_linears()
            return ModuleSpec(module=TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=fc1, linear_fc2=fc2))
        linears = MLPSubmodules(
            linear_fc1=self.column_parallel_linear(),
            linear_fc2=self.row_parallel_linear(),
            activation_func=self.activation_func(),
        )
        return ModuleSpec(module=SequentialMLP, submodules=linears)

    def _grouped_linears(self) -> tuple:
        return ColumnParallelGroupedLinear, RowParallelGroupedLinear


class LocalSpecProvider(BackendSpecProvider):
    """This project's modules: tensor-parallel linears, PyTorch norms, SDPA core attention."""

    def column_parallel_linear(self) -> type:
        return ColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return RowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return False

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return None

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        # WrappedTorchNorm reads config.normalization (or the spec's `normalization` param), so one class serves both.
        return WrappedTorchNorm

    def l2_norm(self) -> type:
        """The parameter-free q/k norm of ``qk_l2_norm``."""
        return L2Norm

    def core_attention(self) -> type:
        return DotProductAttention

    def activation_func(self) -> Optional[type]:
        return None


class TELayoutSpecProvider(LocalSpecProvider):
    """The local modules in Transformer Engine's checkpoint layout (Megatron's ``TESpecProvider`` keys): the norm
    in front of QKV / fc1 fused into the linear, norms, linears and core attention with ``_extra_state``."""

    def column_parallel_linear(self) -> type:
        return TELayoutColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return TELayoutRowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> Optional[type]:
        return TELayoutLayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return TELayoutNorm

    def core_attention(self) -> type:
        return TELayoutDotProductAttention

    def _grouped_linears(self) -> tuple:
        return TELayoutColumnParallelGroupedLinear, TELayoutRowParallelGroupedLinear
