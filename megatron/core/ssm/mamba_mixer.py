"""The Mamba-2 mixer (Dao & Gu, arXiv 2405.21060) with Megatron-Core's parameters, tensor-parallel split and
checkpoint layout.

``in_proj`` (column-parallel) maps ``[s, b, d_model]`` to ``z | x | B | C | dt`` (sizes ``d_inner, d_inner,
ngroups*d_state, ngroups*d_state, nheads``); ``[x, B, C]`` go through a causal depthwise conv1d and SiLU; the SSD scan
runs with ``dt = softplus(dt + dt_bias)``, ``A = -exp(A_log)`` and the ``D`` skip; a gated RMSNorm over groups of
``d_inner / ngroups`` channels applies ``silu(z)``; ``out_proj`` (row-parallel) maps back to ``d_model``.

Tensor parallelism splits heads and groups: rank r of t holds heads ``[r*h/t, (r+1)*h/t)`` and groups
``[r*g/t, (r+1)*g/t)``, so its in_proj rows are ``[z_r | x_r | B_r | C_r | dt_r]`` (piece r of each segment), its conv
channels ``[x_r | B_r | C_r]`` and its slices of ``A_log``, ``D``, ``dt_bias`` and the norm weight. Heads only read
groups on their own rank, so nothing is communicated between in_proj and out_proj. The checkpoint stores every
segment as a full tensor of its own (``in_proj.weight.z`` ...), so it does not depend on the TP size.

Inference: ``forward(hidden_states, inference_context=ctx)`` carries a conv state ``[conv channels, d_conv]`` and an
SSM state ``[heads, headdim, d_state]`` per request instead of a KV cache, each rank its own heads' and channels'
part. The context provides ``is_decode_only()`` and ``mamba_states_cache(layer_number - pp_layer_offset) ->
(conv_state [slots, ...], ssm_state [slots, ...])``, optionally ``mamba_metadata`` (``batch_indices_prefill`` /
``batch_indices_decode``: the slot of each batch row, else ``batch_size_offset + row``; ``prefill_lengths`` for
right-padded prompts of different lengths; ``prefill_has_initial_states`` for rows continuing a chunked prefill).
Prefill (``is_decode_only()`` False) runs the chunked scan over the prompts from zero states (or the stored ones)
and writes the states after each prompt's last token into the slots; decode (True, one
token per request) shifts the conv state, applies the depthwise conv and advances the recurrence
``h = exp(dt A) h + dt x B^T``, ``y = h C + D x`` in O(1), then the gated norm and out_proj. The full protocol and the
state layout: :mod:`megatron.core.ssm.mamba_inference`; ``allocate_inference_cache`` allocates the states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, ShardedTensorFactory
from megatron.core.parallel_state import tp_group_or_default
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm import mamba_inference, ssd_kernels
from megatron.core.ssm.gated_rmsnorm import GatedRMSNorm
from megatron.core.ssm.ssd_chunked import ssd_chunked_scan
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.tensor_parallel.sharded_state import make_sharded_tensors_for_checkpoint
from megatron.core.transformer.utils import sharded_state_dict_default
from megatron.core.utils import cuda_available, get_current_device, warn_once

if TYPE_CHECKING:
    # The inference contexts live in megatron.core.inference; the mixer only needs the protocol of
    # megatron.core.ssm.mamba_inference, so it does not import them. The annotation keeps Megatron's name.
    BaseInferenceContext = Any


@dataclass
class MambaMixerSubmodules:
    """The mixer's projections: ``in_proj`` a ColumnParallelLinear-like builder (Transformer Engine's fused
    norm+linear in Megatron's TE spec), ``out_proj`` a RowParallelLinear-like builder."""

    in_proj: Union[ModuleSpec, type] = None
    out_proj: Union[ModuleSpec, type] = None


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"MambaMixer: {name} must be a positive integer, got {value!r}")


def mamba_mixer_sizes(config: TransformerConfig, d_model: int, expand: int, tp_size: int) -> Tuple[int, int]:
    """``(d_inner, nheads)`` of a mixer, after checking that they split over ``tp_size`` ranks.

    ``d_inner = expand * d_model`` and ``nheads = d_inner / mamba_head_dim``, unless ``config.mamba_num_heads`` is set,
    which fixes ``nheads`` and makes ``d_inner = nheads * mamba_head_dim``. Raises a ``ValueError`` naming the sizes.
    """
    _positive_int("d_model", d_model)
    _positive_int("expand", expand)
    head_dim, ngroups = config.mamba_head_dim, config.mamba_num_groups
    if config.mamba_num_heads is not None:
        nheads = config.mamba_num_heads
        d_inner = nheads * head_dim
    else:
        d_inner = expand * d_model
        if d_inner % head_dim != 0:
            raise ValueError(
                f"MambaMixer: d_inner = expand * d_model = {expand} * {d_model} = {d_inner} is not divisible by "
                f"mamba_head_dim ({head_dim}); change mamba_head_dim, hidden_size or expand, or set mamba_num_heads"
            )
        nheads = d_inner // head_dim
    if nheads % ngroups != 0:
        raise ValueError(
            f"MambaMixer: the number of heads ({nheads}) must be a multiple of mamba_num_groups ({ngroups}); "
            "change mamba_num_groups or mamba_num_heads / mamba_head_dim"
        )
    for name, value in (("heads", nheads), ("mamba_num_groups", ngroups)):
        if value % tp_size != 0:
            raise ValueError(
                f"MambaMixer: {name} ({value}) must be divisible by the tensor-parallel size ({tp_size}); "
                "change the Mamba sizes or tensor_model_parallel_size"
            )
    return d_inner, nheads


def _tp_part(full: torch.Tensor, sections: Sequence[int], tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank ``tp_rank``'s rows of ``full``, whose axis 0 concatenates segments of the given sizes, each split evenly
    over the ranks: piece ``tp_rank`` of every segment, in order."""
    segments = torch.split(full, list(sections), dim=0)
    return torch.cat([segment.chunk(tp_size, dim=0)[tp_rank] for segment in segments], dim=0)


class MambaMixer(MegatronModule):
    """Mamba-2 mixer: ``forward(hidden_states [s, b, d_model])`` returns ``(output, bias)`` like Megatron's, with
    out_proj's bias unapplied (for the layer's bias-dropout-add).

    Arguments are Megatron-Core's: ``d_conv`` conv width; ``conv_init`` uniform bound of the conv weight (None:
    PyTorch's Conv1d init); ``expand`` (``d_inner = expand * d_model``); ``A_init_range`` (A drawn uniformly, stored
    as ``A_log``); ``D_has_hdim`` (``D`` per channel instead of per head); ``rmsnorm`` (False: ``y * silu(z)`` without
    a norm); ``norm_before_gate``; ``dt_min`` / ``dt_max`` / ``dt_init_floor`` (``dt`` drawn log-uniformly, floored,
    stored as ``dt_bias = softplus^-1(dt)``); ``bias`` (in_proj and out_proj biases); ``conv_bias``; ``chunk_size``
    of the SSD scan. ``dt_init`` and ``dt_scale`` are Mamba-1's dt-projection init, which Mamba-2 has no use for;
    they are kept for the signature. State size, head size, groups and heads come from ``config.mamba_*``.

    With ``config.use_cpu_initialization`` every weight is drawn whole on the CPU and split, so the model is the same
    for every TP size; otherwise each rank draws its own part from the tensor-parallel RNG stream, as Megatron does.
    With ``config.use_mamba_mem_eff_path`` and mamba-ssm installed, CUDA inputs go through mamba-ssm's fused
    conv+scan+norm function; without it, through causal-conv1d / ``mamba_chunk_scan_combined`` when installed, else
    through ``torch.nn.Conv1d`` and :func:`~megatron.core.ssm.ssd_chunked.ssd_chunked_scan`.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MambaMixerSubmodules,
        d_model,
        d_conv=4,
        conv_init=None,
        expand=2,
        A_init_range=(1, 16),
        D_has_hdim=False,
        rmsnorm=True,
        norm_before_gate=False,
        dt_min=0.001,
        dt_max=0.1,
        dt_init="random",
        dt_scale=1.0,
        dt_init_floor=1e-4,
        bias=False,
        conv_bias=True,
        chunk_size=128,
        layer_number=None,
        pg_collection: ProcessGroupCollection = None,
        pp_layer_offset: int = 0,
        name: str | None = None,
    ):
        super().__init__(config)
        self.tp_group = tp_group_or_default(pg_collection)
        self.tp_size = torch.distributed.get_world_size(self.tp_group) if self.tp_group is not None else 1
        self.tp_rank = torch.distributed.get_rank(self.tp_group) if self.tp_group is not None else 0
        self._check_arguments(d_conv, A_init_range, dt_min, dt_max, dt_init_floor, chunk_size)
        self.d_model, self.d_conv, self.conv_init, self.expand = d_model, d_conv, conv_init, expand
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_init, self.dt_scale = dt_init, dt_scale
        self.chunk_size = chunk_size
        self.layer_number, self.pp_layer_offset, self.name = layer_number, pp_layer_offset, name
        self.pg_collection = pg_collection

        self.d_state, self.headdim = config.mamba_state_dim, config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        self.d_inner, self.nheads = mamba_mixer_sizes(config, d_model, expand, self.tp_size)
        self.d_inner_local_tp = self.d_inner // self.tp_size
        self.ngroups_local_tp = self.ngroups // self.tp_size
        self.nheads_local_tp = self.nheads // self.tp_size
        group_width = self.ngroups * self.d_state
        self.in_proj_sections = [self.d_inner, self.d_inner, group_width, group_width, self.nheads]
        self.conv_sections = [self.d_inner, group_width, group_width]
        self.use_mem_eff_path = config.use_mamba_mem_eff_path
        # Only where the kernels could run: on a CPU-only machine the PyTorch path is the one path (Megatron's
        # default True would otherwise warn on every CPU run).
        if self.use_mem_eff_path and cuda_available() and not ssd_kernels.kernels_usable():
            warn_once(
                "use_mamba_mem_eff_path=True but mamba-ssm is not installed: the Mamba mixer runs the pure-PyTorch "
                "conv1d and chunked SSD scan (same results, more activation memory)"
            )

        self.in_proj = build_module(
            submodules.in_proj,
            self.d_model,
            sum(self.in_proj_sections),
            config=config,
            init_method=self._in_proj_init_method(config.init_method),
            gather_output=False,
            bias=bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
        )
        self._build_mixer_parameters(conv_bias, A_init_range, dt_min, dt_max, dt_init_floor)
        if rmsnorm:
            self.norm = GatedRMSNorm(
                self.d_inner_local_tp,
                eps=1e-5,
                group_size=self.d_inner_local_tp // self.ngroups_local_tp,
                norm_before_gate=norm_before_gate,
                device=get_current_device(),
                dtype=config.params_dtype,
            )
        self.out_proj = build_module(
            submodules.out_proj,
            self.d_inner,
            self.d_model,
            config=config,
            init_method=config.output_layer_init_method,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
        )

    # ---- construction --------------------------------------------------------------------------------------------

    def _check_arguments(self, d_conv, A_init_range, dt_min, dt_max, dt_init_floor, chunk_size) -> None:
        _positive_int("d_conv", d_conv)
        _positive_int("chunk_size", chunk_size)
        low, high = A_init_range
        if not 0 < low <= high:
            raise ValueError(f"MambaMixer: A_init_range must satisfy 0 < low <= high, got {tuple(A_init_range)}")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"MambaMixer: dt_min and dt_max must satisfy 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
        if dt_init_floor < 0:
            raise ValueError(f"MambaMixer: dt_init_floor must be >= 0, got {dt_init_floor}")
        if self.config.context_parallel_size > 1:
            raise ValueError(
                f"MambaMixer: context_parallel_size={self.config.context_parallel_size} is not supported by the Mamba "
                "mixer; use context_parallel_size=1 for hybrid models"
            )

    def _in_proj_init_method(self, init_method: Callable) -> Callable:
        """``init_method`` that, given the whole in_proj weight (CPU initialisation), draws it in the global
        ``z|x|B|C|dt`` order and then arranges its rows so that the column-parallel split hands rank r its
        ``[z_r|x_r|B_r|C_r|dt_r]``. Given one rank's part (device initialisation) it just draws."""
        sections, tp_size = self.in_proj_sections, self.tp_size

        def init(weight: torch.Tensor) -> None:
            init_method(weight)
            if tp_size > 1 and weight.shape[0] == sum(sections):
                with torch.no_grad():
                    weight.copy_(torch.cat([_tp_part(weight, sections, r, tp_size) for r in range(tp_size)]))

        return init

    def _draw(self, shape: Tuple[int, ...], sections: Sequence[int], draw: Callable[[torch.Tensor], None]):
        """This rank's part of a tensor drawn by ``draw`` (in place, fp32): drawn whole on the CPU from the default
        generator and split by ``sections`` under CPU initialisation, else only this part, from the TP stream."""
        if self.config.use_cpu_initialization:
            full = torch.empty(sum(sections), *shape[1:], dtype=torch.float32)
            draw(full)
            return _tp_part(full, sections, self.tp_rank, self.tp_size).to(get_current_device())
        with get_cuda_rng_tracker().fork():
            part = torch.empty(shape, dtype=torch.float32, device=get_current_device())
            draw(part)
        return part

    @torch.no_grad()
    def _build_mixer_parameters(self, conv_bias, A_init_range, dt_min, dt_max, dt_init_floor) -> None:
        device, dtype = get_current_device(), self.config.params_dtype
        conv_dim = self.d_inner_local_tp + 2 * self.ngroups_local_tp * self.d_state
        # Built without PyTorch's init (it would draw a TP-dependent amount); drawn below instead.
        self.conv1d = torch.nn.utils.skip_init(
            torch.nn.Conv1d,
            in_channels=conv_dim,
            out_channels=conv_dim,
            bias=conv_bias,
            kernel_size=self.d_conv,
            groups=conv_dim,
            padding=self.d_conv - 1,
            device=device,
            dtype=dtype,
        )
        # PyTorch's Conv1d default: uniform(+-1/sqrt(fan_in)) with fan_in = d_conv for a depthwise conv.
        bound = 1.0 / math.sqrt(self.d_conv)
        weight_bound = self.conv_init if self.conv_init is not None else bound
        weight_shape = tuple(self.conv1d.weight.shape)
        self.conv1d.weight.copy_(
            self._draw(weight_shape, self.conv_sections, lambda t: t.uniform_(-weight_bound, weight_bound))
        )
        if conv_bias:
            self.conv1d.bias.copy_(self._draw((conv_dim,), self.conv_sections, lambda t: t.uniform_(-bound, bound)))
        for param in self.conv1d.parameters():
            _mark_tensor_parallel(param)

        heads = (self.nheads_local_tp,)
        log_min, log_max = math.log(dt_min), math.log(dt_max)
        dt = self._draw(heads, [self.nheads], lambda t: t.uniform_().mul_(log_max - log_min).add_(log_min).exp_())
        dt = dt.clamp(min=dt_init_floor)
        # dt_bias = softplus^-1(dt), so that softplus(0 + dt_bias) reproduces the drawn dt.
        self.dt_bias = torch.nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        A = self._draw(heads, [self.nheads], lambda t: t.uniform_(*A_init_range))
        self.A_log = torch.nn.Parameter(torch.log(A))
        d_size = self.d_inner_local_tp if self.D_has_hdim else self.nheads_local_tp
        self.D = torch.nn.Parameter(torch.ones(d_size, dtype=torch.float32, device=device))
        for param in (self.dt_bias, self.A_log, self.D):
            _mark_tensor_parallel(param)
            param._no_weight_decay = True
        self.dt_bias._no_reinit = True

    # ---- forward -------------------------------------------------------------------------------------------------

    def forward(
        self,
        hidden_states,
        inference_context=None,
        *,
        inference_params: Optional[BaseInferenceContext] = None,
        packed_seq_params=None,
    ):
        """``(output [s, b, d_model], out_proj bias or None)`` for ``hidden_states [s, b, d_model]`` (this rank's
        ``[s/tp, b, d_model]`` slice under sequence parallelism). With ``inference_context`` the mixer prefills or
        decodes against the context's conv and SSM states (protocol: :mod:`megatron.core.ssm.mamba_inference`)."""
        inference_context = inference_context if inference_context is not None else inference_params
        if packed_seq_params is not None:
            raise ValueError("MambaMixer: packed sequences (packed_seq_params) are not supported; pass None")
        if inference_context is not None:
            return self._inference_forward(hidden_states, inference_context)
        zxbcdt, _ = self.in_proj(hidden_states)
        zxbcdt = zxbcdt.transpose(0, 1)  # [b, s, d]: the scan's layout
        if self.use_mem_eff_path and ssd_kernels.kernels_usable(zxbcdt):
            y = self._fused_conv_scan_norm(zxbcdt)
        else:
            y, _, _ = self._conv_scan_norm(zxbcdt)
        return self.out_proj(y.transpose(0, 1))

    def _conv_scan_norm(
        self,
        zxbcdt: torch.Tensor,
        return_states: bool = False,
        prefill_lengths: Optional[torch.Tensor] = None,
        initial_states: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(y [b, s, d_inner_local], conv state, SSM state)``; the states (see ``mamba_inference``) are those after
        each sequence's last step (after ``prefill_lengths[i]`` steps when given), computed only with
        ``return_states``. ``initial_states`` ``(conv inputs before the sequence [b, d_conv - 1, channels], SSM
        state [b, h, p, n])`` continue sequences from earlier steps instead of from zeros."""
        batch, seqlen, _ = zxbcdt.shape
        group_width = self.ngroups_local_tp * self.d_state
        z, xBC, dt = torch.split(
            zxbcdt, [self.d_inner_local_tp, self.d_inner_local_tp + 2 * group_width, self.nheads_local_tp], dim=-1
        )
        earlier = 0
        if initial_states is not None:
            # The conv runs over the earlier inputs and the sequence; only the sequence's outputs are kept.
            earlier = self.d_conv - 1
            xBC = torch.cat([initial_states[0].to(xBC.dtype), xBC], dim=1)
        conv_state = None
        if return_states:
            conv_lengths = None if prefill_lengths is None else prefill_lengths + earlier
            conv_state = mamba_inference.conv_state_after_prompt(xBC, self.d_conv, conv_lengths)
        xBC = self._causal_conv_silu(xBC, use_kernel=initial_states is None)[:, earlier:]
        x, B, C = torch.split(xBC, [self.d_inner_local_tp, group_width, group_width], dim=-1)
        heads = (batch, seqlen, self.nheads_local_tp, self.headdim)
        groups = (batch, seqlen, self.ngroups_local_tp, self.d_state)
        scan_args = dict(
            D=self.D.view(self.nheads_local_tp, self.headdim) if self.D_has_hdim else self.D,
            z=None if self.rmsnorm else z.reshape(heads),
            dt_bias=self.dt_bias,
            dt_softplus=True,
            return_final_states=return_states,
            initial_states=None if initial_states is None else initial_states[1],
        )
        if prefill_lengths is not None:
            # Steps past a prompt's end get dt = 0 after the softplus, so its final state is the one at its end.
            dt = mamba_inference.mask_padded_steps(F.softplus(dt.float() + self.dt_bias.float()), prefill_lengths)
            scan_args.update(dt_bias=None, dt_softplus=False)
        A = -torch.exp(self.A_log.float())
        x, B, C = x.reshape(heads), B.reshape(groups), C.reshape(groups)
        if ssd_kernels.kernels_usable(x):
            out = ssd_kernels.mamba_chunk_scan_combined(x, dt, A, B, C, self.chunk_size, **scan_args)
        else:
            states_dtype = self.config.mamba_training_ssm_states_dtype
            out = ssd_chunked_scan(x, dt, A, B, C, self.chunk_size, states_dtype=states_dtype, **scan_args)
        y, ssm_state = out if return_states else (out, None)
        y = y.reshape(batch, seqlen, self.d_inner_local_tp)
        return (self.norm(y, z) if self.rmsnorm else y), conv_state, ssm_state

    # ---- inference -----------------------------------------------------------------------------------------------

    def _inference_forward(self, hidden_states: torch.Tensor, inference_context: Any):
        """Prefill (chunked scan, then store the states) or decode (one O(1) step from the stored states)."""
        if self.config.sequence_parallel:
            raise ValueError(
                "MambaMixer: inference_context with sequence_parallel=True is not supported (a decode step has one "
                "token per request, which cannot be split over ranks); build the inference model with "
                "sequence_parallel=False"
            )
        if self.layer_number is None:
            raise ValueError(
                "MambaMixer: inference_context needs the mixer's layer_number (it names the layer's states in the "
                "context); build the mixer with layer_number"
            )
        decode = mamba_inference.is_decode_step(inference_context)
        seqlen, batch = hidden_states.shape[:2]
        if decode and seqlen != 1:
            raise ValueError(
                f"MambaMixer: a decode step (inference_context.is_decode_only() is True) takes one token per request, "
                f"got hidden_states of shape {tuple(hidden_states.shape)}; pass [1, batch, hidden]"
            )
        local_layer_number = self.layer_number - self.pp_layer_offset
        conv_state, ssm_state = inference_context.mamba_states_cache(local_layer_number)
        mamba_inference.check_state_shapes(
            conv_state, ssm_state, *self.mamba_state_shapes_per_request(), self.layer_number
        )
        slots = mamba_inference.state_slots(inference_context, batch, decode, hidden_states.device)
        zxbcdt, _ = self.in_proj(hidden_states)
        zxbcdt = zxbcdt.transpose(0, 1)  # [b, s, d]
        if decode:
            y = self._decode_step(zxbcdt[:, 0], conv_state, ssm_state, slots).unsqueeze(1)
        else:
            lengths = mamba_inference.prefill_lengths(inference_context)
            initial = mamba_inference.prefill_initial_states(inference_context, conv_state, ssm_state, slots)
            y, new_conv, new_ssm = self._conv_scan_norm(
                zxbcdt, return_states=True, prefill_lengths=lengths, initial_states=initial
            )
            conv_state[slots] = new_conv.to(conv_state.dtype)
            ssm_state[slots] = new_ssm.to(ssm_state.dtype)
        return self.out_proj(y.transpose(0, 1))

    def _decode_step(
        self, zxbcdt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """``y [b, d_inner_local]`` for one token per request (``zxbcdt [b, d]``), updating the rows ``slots`` of
        ``conv_state`` and ``ssm_state`` in place."""
        batch = zxbcdt.shape[0]
        group_width = self.ngroups_local_tp * self.d_state
        z, xBC, dt = torch.split(
            zxbcdt, [self.d_inner_local_tp, self.d_inner_local_tp + 2 * group_width, self.nheads_local_tp], dim=-1
        )
        xBC, new_conv = mamba_inference.conv_step(conv_state[slots], xBC, self.conv1d.weight[:, 0], self.conv1d.bias)
        conv_state[slots] = new_conv
        x, B, C = torch.split(xBC, [self.d_inner_local_tp, group_width, group_width], dim=-1)
        heads = (batch, self.nheads_local_tp, self.headdim)
        groups = (batch, self.ngroups_local_tp, self.d_state)
        y, new_ssm = mamba_inference.ssm_step(
            ssm_state[slots],
            x.reshape(heads),
            F.softplus(dt.float() + self.dt_bias.float()),
            -torch.exp(self.A_log.float()),
            B.reshape(groups),
            C.reshape(groups),
            self.D.view(self.nheads_local_tp, self.headdim) if self.D_has_hdim else self.D,
        )
        ssm_state[slots] = new_ssm.to(ssm_state.dtype)
        if not self.rmsnorm:
            y = y * F.silu(z.float().reshape(heads))
        y = y.reshape(batch, self.d_inner_local_tp).to(zxbcdt.dtype)
        return self.norm(y, z) if self.rmsnorm else y

    def allocate_inference_cache(self, batch_size: int, max_seqlen: int, dtype: Optional[torch.dtype] = None):
        """Zeroed ``(conv_state [batch_size, *conv shape], ssm_state [batch_size, *SSM shape])`` for this rank (shapes
        of :meth:`mamba_state_shapes_per_request`). ``max_seqlen`` is unused: the states do not grow with the
        sequence (the argument is mamba-ssm's). ``dtype`` sets both; by default the conv state has the conv weight's
        dtype and the SSM state is fp32, so a bf16 model does not round its recurrent state every step."""
        conv_shape, ssm_shape = self.mamba_state_shapes_per_request()
        device = self.conv1d.weight.device
        conv_state = torch.zeros(batch_size, *conv_shape, device=device, dtype=dtype or self.conv1d.weight.dtype)
        ssm_state = torch.zeros(batch_size, *ssm_shape, device=device, dtype=dtype or torch.float32)
        return conv_state, ssm_state

    def _causal_conv_silu(self, xBC: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
        """``silu(causal depthwise conv(xBC))`` for ``xBC [b, s, channels]``."""
        seqlen = xBC.shape[1]
        channels_first = xBC.transpose(1, 2)
        if use_kernel and ssd_kernels.conv1d_kernel_usable(channels_first):
            out = ssd_kernels.causal_conv1d_fn(
                x=channels_first, weight=self.conv1d.weight.squeeze(1), bias=self.conv1d.bias, activation="silu"
            )
        else:
            # padding = d_conv - 1 on both sides; keeping the first seqlen outputs makes the conv causal.
            out = F.silu(self.conv1d(channels_first)[..., :seqlen])
        return out.transpose(1, 2)

    def _fused_conv_scan_norm(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        """mamba-ssm's fused conv + scan + gated norm (out_proj stays outside: it is row-parallel)."""
        return ssd_kernels.mamba_split_conv1d_scan_combined(
            zxbcdt,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.dt_bias.float(),
            -torch.exp(self.A_log.float()),
            D=self.D.view(self.nheads_local_tp, self.headdim) if self.D_has_hdim else self.D,
            chunk_size=self.chunk_size,
            activation="silu",
            rmsnorm_weight=self.norm.weight if self.rmsnorm else None,
            rmsnorm_eps=self.norm.eps if self.rmsnorm else 1e-6,
            outproj_weight=None,
            outproj_bias=None,
            headdim=None if self.D_has_hdim else self.headdim,
            ngroups=self.ngroups_local_tp,
            norm_before_gate=self.norm_before_gate,
        )

    def mamba_state_shapes_per_request(self) -> Tuple[Tuple[int], Tuple[int]]:
        """``((conv channels, d_conv), (heads, headdim, d_state))``: this rank's conv and SSM state of one
        sequence, for sizing an inference cache."""
        return (self.conv1d.weight.shape[0], self.d_conv), (self.nheads_local_tp, self.headdim, self.d_state)

    # ---- checkpoint ----------------------------------------------------------------------------------------------

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None) -> ShardedStateDict:
        """Megatron-Core's keys: ``A_log``, ``D``, ``dt_bias``, ``conv1d.*`` and ``norm.weight`` split over TP along
        axis 0; ``in_proj.weight`` stored as ``.z .x .B .C .dt`` and ``conv1d.weight`` / ``conv1d.bias`` as
        ``.x .B .C``, each a whole tensor split over TP (so the checkpoint reshards to any TP size). An in_proj bias
        (``bias=True``) is split the same way."""
        groups = dict(tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        own_state = {}
        self._save_to_state_dict(own_state, "", keep_vars=True)
        sharded_state_dict = make_sharded_tensors_for_checkpoint(
            own_state, prefix, {"A_log": 0, "D": 0, "dt_bias": 0}, sharded_offsets, **groups
        )
        for name, module in self.named_children():
            if name in ("conv1d", "norm"):
                sharded_state_dict.update(
                    make_sharded_tensors_for_checkpoint(
                        module.state_dict(prefix="", keep_vars=True),
                        f"{prefix}{name}.",
                        {"weight": 0, "bias": 0},
                        sharded_offsets,
                        **groups,
                    )
                )
            else:
                sharded_state_dict.update(
                    sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata)
                )
        local_in_proj = [size // self.tp_size for size in self.in_proj_sections]
        local_conv = [size // self.tp_size for size in self.conv_sections]
        splits = {
            "in_proj.weight": (local_in_proj, ["z", "x", "B", "C", "dt"]),
            "in_proj.bias": (local_in_proj, ["z", "x", "B", "C", "dt"]),
            "conv1d.weight": (local_conv, ["x", "B", "C"]),
            "conv1d.bias": (local_conv, ["x", "B", "C"]),
        }
        for name, (sections, names) in splits.items():
            key = f"{prefix}{name}"
            if key in sharded_state_dict:
                sharded_state_dict[key] = split_tensor_factory(sharded_state_dict[key], sections, names)
        return sharded_state_dict


def _mark_tensor_parallel(param: torch.Tensor) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = 0
    param.partition_stride = 1


def split_tensor_factory(
    original: ShardedTensor, split_sections: List[int], split_names: List[str]
) -> ShardedTensorFactory:
    """Store ``original`` -- this rank's TP piece of a tensor whose axis 0 concatenates segments -- as one tensor per
    segment, ``<key>.<name>``, each split over TP like the original.

    Rank r's local rows are ``split_sections`` rows of each segment in turn (piece r of each), so segment ``i``'s part
    becomes piece r of global tensor ``<key>.<name_i>``. On load the parts are concatenated back. With a
    ``flattened_range`` (the distributed optimizer's flat shard of the local tensor) only the segments it overlaps
    are stored, as flat slices.
    """
    if sum(split_sections) != original.local_shape[0] or len(split_sections) != len(split_names):
        raise ValueError(
            f"split_tensor_factory: sections {split_sections} (names {split_names}) do not tile axis 0 of "
            f"{original.key!r}'s local shape {tuple(original.local_shape)}"
        )
    prepend = original.prepend_axis_num
    tp_axis = prepend
    tp_size = original.axis_fragmentations[tp_axis]
    tp_rank = original.global_offset[tp_axis] // original.local_shape[0]
    prepended = tuple((axis, original.global_offset[axis], original.global_shape[axis]) for axis in range(prepend))
    row_numel = math.prod(original.local_shape[1:])
    offsets = [sum(split_sections[:i]) for i in range(len(split_sections))]

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        common = dict(replica_id=replica_id, prepend_axis_num=prepend)
        placement = (*prepended, (tp_axis, tp_rank, tp_size))
        pieces = {}
        if flattened_range is None:
            for name, part in zip(split_names, torch.split(data, split_sections, dim=0)):
                pieces[name] = ShardedTensor.from_rank_offsets(f"{key}.{name}", part, *placement, **common)
            return pieces
        start, stop = flattened_range.start, flattened_range.stop
        for name, size, first_row in zip(split_names, split_sections, offsets):
            piece_start, piece_stop = first_row * row_numel, (first_row + size) * row_numel
            low, high = max(start, piece_start), min(stop, piece_stop)
            if low >= high:
                continue
            pieces[name] = ShardedTensor.from_rank_offsets_flat(
                f"{key}.{name}",
                data[low - start : high - start],
                (size, *original.local_shape[1:]),
                *placement,
                flattened_range=slice(low - piece_start, high - piece_start),
                **common,
            )
        return pieces

    @torch.no_grad()
    def merge(loaded):
        return torch.cat([loaded[name] for name in split_names if name in loaded])

    return ShardedTensorFactory(
        original.key, original.data, build, merge, original.replica_id, flattened_range=original.flattened_range
    )
