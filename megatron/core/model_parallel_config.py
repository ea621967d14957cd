"""ModelParallelConfig: how a model is split and run (Megatron-Core's field names and defaults)."""

from dataclasses import dataclass
from typing import Callable, ContextManager, List, Optional

import torch

from megatron.core.not_supported_yet import refuse_features_not_supported_yet
from megatron.core.rank_generator import check_layout
from megatron.core.utils import warn_once


@dataclass
class ModelParallelConfig:
    """Parallelism, precision and pipeline-communication settings shared by every Megatron-Core module."""

    # ---- model parallelism ----
    tensor_model_parallel_size: int = 1
    """Number of tensor-parallel ranks a layer's weights are split over."""
    tensor_parallel_num_weight_shards: Optional[int] = None
    """GTP weight rematerialisation: weight shards per tensor-parallel group (not supported yet: must be None)."""
    gtp_weight_remat_size: int = 1
    """GTP weight rematerialisation group size (not supported yet: must be 1)."""
    pipeline_model_parallel_comm_backend: Optional[str] = None
    """Backend for pipeline send/recv (None: the default backend)."""
    pipeline_model_parallel_size: int = 1
    """Number of pipeline stages."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule (None: no interleaving)."""
    sequence_parallel: bool = False
    """Split the activations of non-tensor-parallel regions (norms, dropout) along the sequence over the TP group."""
    context_parallel_size: int = 1
    """Number of ranks the sequence is split over (context parallelism; attention exchanges keys/values as
    TransformerConfig.cp_comm_type says)."""
    hierarchical_context_parallel_sizes: Optional[List[int]] = None
    """Group sizes of hierarchical context parallelism, ``[a2a size, p2p size]`` for cp_comm_type='a2a+p2p'
    (product = context_parallel_size)."""
    max_seqlen_per_dp_cp_rank: Optional[int] = None
    """Hybrid context parallelism: longest sequence one DP x CP rank holds (not supported yet: must be None)."""
    hybrid_context_parallel: bool = False
    """Balance packed variable-length samples over CP ranks (not supported yet: must be False)."""
    expert_model_parallel_size: int = 1
    """Number of ranks the MoE experts are distributed over."""
    expert_tensor_parallel_size: Optional[int] = None
    """Tensor-parallel size inside each expert (None: same as tensor_model_parallel_size)."""
    expert_tensor_parallel_num_weight_shards: Optional[int] = None
    """GTP weight rematerialisation for experts: weight shards (not supported yet: must be None)."""
    expert_gtp_weight_remat_size: int = 1
    """GTP weight rematerialisation group size for experts (not supported yet: must be 1)."""

    # ---- initialisation ----
    perform_initialization: bool = True
    """Initialise weights (off when they are about to be loaded from a checkpoint)."""
    use_cpu_initialization: bool = False
    """Initialise each full weight once on the CPU from the seed, then split it: identical models for every TP size."""

    # ---- precision ----
    fp16: bool = False
    """Run the model in float16."""
    bf16: bool = False
    """Run the model in bfloat16."""
    params_dtype: torch.dtype = torch.float32
    """Dtype the parameters are created in."""
    timers: Optional[Callable] = None
    """Megatron Timers object, if the caller wants per-phase timings."""

    # ---- hooks used by the schedules and DDP ----
    finalize_model_grads_func: Optional[Callable] = None
    """Called once after the last backward of a step (DP reduction, tied-embedding and SP-norm all-reduces)."""
    grad_scale_func: Optional[Callable] = None
    """Scales the loss before backward (the loss scaler)."""
    moe_grad_scale_func: Optional[Callable] = None
    """A caller's own scale for the MoE auxiliary losses (not supported yet, must be None: the schedules scale them
    by the loss scale over the number of micro-batches, as Megatron-Core does by default)."""
    mtp_grad_scale_func: Optional[Callable] = None
    """Scale of the multi-token-prediction loss (not supported yet: MTP is not built, must be None)."""
    no_sync_func: Optional[Callable] = None
    """Context manager factory that suspends gradient reduction (DDP's no_sync) between micro-batches."""
    grad_sync_func: Optional[Callable] = None
    """Launches a model chunk's gradient reduction (overlapped with the pipeline)."""
    param_sync_func: Optional[Callable] = None
    """Launches a model chunk's parameter all-gather (distributed optimizer, overlapped with the pipeline)."""
    deterministic_mode: bool = False
    """Prefer deterministic kernels."""
    enable_autocast: bool = False
    """Run forward passes under torch.autocast with autocast_dtype."""
    autocast_dtype: Optional[torch.dtype] = None
    """Autocast dtype (None: params_dtype)."""
    num_microbatches_with_partial_activation_checkpoints: Optional[int] = None
    """Micro-batches that recompute only part of the layers (None: all recompute alike)."""

    # ---- fused kernels and GPU communication overlap (accepted; no-ops where the kernel is absent) ----
    gradient_accumulation_fusion: bool = False
    """Accumulate the linear layers' weight-gradient GEMM straight into ``main_grad`` (needs DDP's ``main_grad``;
    megatron.core.fusions.fused_weight_gradient: a Triton kernel on CUDA, ``addmm_`` on CPU)."""
    use_te_rng_tracker: bool = False
    """Use Transformer Engine's RNG tracker (only with Transformer Engine)."""
    tp_comm_overlap: bool = False
    """Overlap the sequence-parallel all-gathers / reduce-scatters of the transformer layers' linears with their
    GEMMs, chunk by chunk, with asynchronous collectives (megatron.core.tensor_parallel.comm_overlap; no Transformer
    Engine needed). Needs sequence_parallel and tensor_model_parallel_size > 1."""
    tp_comm_bulk_wgrad: bool = True
    """tp_comm_overlap: overlap the column-parallel backward's input all-gather with the activation-gradient GEMM."""
    tp_comm_bulk_dgrad: bool = True
    """tp_comm_overlap: overlap the column-parallel backward's reduce-scatter with the weight-gradient GEMM."""
    tp_comm_overlap_ag: bool = True
    """tp_comm_overlap: pipeline all-gathers with GEMMs (column-parallel forward, row-parallel backward)."""
    tp_comm_overlap_rs: bool = True
    """tp_comm_overlap: pipeline reduce-scatters with GEMMs (row-parallel forward)."""
    tp_comm_overlap_rs_dgrad: bool = False
    """tp_comm_overlap: pipeline the column-parallel input-gradient reduce-scatter with its GEMM (instead of the bulk
    overlap with the weight-gradient GEMM)."""
    tp_comm_split_ag: bool = True
    """tp_comm_overlap: split all-gather overlap (deprecated in Transformer Engine; no effect here)."""
    tp_comm_atomic_ag: bool = False
    """tp_comm_overlap: atomic all-gather overlap (deprecated in Transformer Engine; no effect here)."""
    tp_comm_split_rs: bool = True
    """tp_comm_overlap: split reduce-scatter overlap (deprecated in Transformer Engine; no effect here)."""
    tp_comm_atomic_rs: bool = False
    """tp_comm_overlap: atomic reduce-scatter overlap (deprecated in Transformer Engine; no effect here)."""
    cross_entropy_loss_fusion: bool = False
    """Fused vocab-parallel cross entropy kernel."""
    cross_entropy_fusion_impl: str = "native"
    """Which fused cross entropy cross_entropy_loss_fusion would use: 'native' or 'te' (no effect here)."""
    tp_comm_overlap_disable_qkv: bool = False
    """tp_comm_overlap: no all-gather overlap for the QKV projection."""
    tp_comm_overlap_disable_fc1: bool = False
    """tp_comm_overlap: no all-gather overlap for the first MLP projection."""
    tp_comm_bootstrap_backend: str = "nccl"
    """tp_comm_overlap: backend that bootstraps the userbuffers, 'nccl', 'mpi' or 'gloo' (no effect here)."""
    overlap_moe_expert_parallel_comm: bool = False
    """Overlap expert-parallel all-to-alls with other micro-batches' compute (not supported yet: must be False)."""
    delay_wgrad_compute: bool = False
    """Delay weight-gradient GEMMs for expert-parallel overlap (not supported yet: must be False)."""
    overlap_dispatch_backward_with_experts_wgrad: bool = False
    """Overlap the expert weight gradients with the dispatch backward (not supported yet: must be False)."""
    ep_overlap_early_attn_memory_release: bool = False
    """Expert-parallel overlap: run the attention backward earlier (not supported yet: must be False)."""

    # ---- pipeline communication ----
    pipeline_dtype: Optional[torch.dtype] = None
    """Dtype of activations sent between pipeline stages (required when pipeline_model_parallel_size > 1)."""
    variable_seq_lengths: bool = False
    """Exchange tensor shapes before each pipeline send (sequence lengths differ between micro-batches)."""
    overlap_p2p_comm: bool = False
    """Overlap pipeline send/recv with compute (interleaved schedule)."""
    batch_p2p_comm: bool = True
    """Issue pipeline sends and receives together with batch_isend_irecv."""
    batch_p2p_sync: bool = True
    """Synchronise after batched pipeline communication (works around old NCCL races)."""
    use_ring_exchange_p2p: bool = False
    """Custom ring-exchange kernel (not available here)."""
    deallocate_pipeline_outputs: bool = False
    """Free a stage's output tensor data once it has been sent (keeps only its autograd graph)."""
    defer_embedding_wgrad_compute: bool = False
    """Defer the output-layer weight-gradient GEMMs to the pipeline flush."""
    wgrad_deferral_limit: int = 0
    """How many micro-batches' output-layer weight gradients may be deferred (0: all)."""
    overlap_p2p_comm_warmup_flush: bool = False
    """Also overlap pipeline communication in the warm-up and flush phases."""
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Micro-batches run consecutively on one virtual stage (None: pipeline_model_parallel_size)."""
    mtp_standalone: bool = False
    """Multi-token prediction runs in its own virtual pipeline stage (not supported yet: must be False)."""

    # ---- offloading (activations of whole layers; the weights and buffering knobs are not built yet) ----
    cpu_offloading: bool = False
    """Keep what the first cpu_offloading_num_layers layers save for backward in host memory until backward
    (megatron.core.transformer.activation_offload)."""
    cpu_offloading_num_layers: int = 0
    """Layers (from the first) whose activations are offloaded with cpu_offloading."""
    _cpu_offloading_context: Optional[ContextManager] = None
    """Internal: the offloading context of the running model; never set it."""
    cpu_offloading_activations: bool = True
    """Offload activations (with cpu_offloading)."""
    cpu_offloading_weights: bool = False
    """Offload weights."""
    cpu_offloading_double_buffering: bool = False
    """Double-buffer the reload of offloaded activations across layers."""
    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    """Keep the pinned host buffers between iterations."""
    barrier_with_L1_time: bool = True
    """Timers: use barriers when measuring level-1 times."""

    def __post_init__(self):
        _validate_parallel_sizes(self)
        _validate_precision(self)
        _validate_tp_comm_overlap(self)
        # Checks every field of the concrete class, TransformerConfig's included, before anything is derived.
        refuse_features_not_supported_yet(self)
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError(
                "pipeline_dtype must be set when pipeline_model_parallel_size > 1 "
                f"(got pipeline_model_parallel_size={self.pipeline_model_parallel_size}); "
                "use params_dtype, e.g. torch.float32 or torch.bfloat16"
            )
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.microbatch_group_size_per_vp_stage is None:
            self.microbatch_group_size_per_vp_stage = self.pipeline_model_parallel_size
        if self.expert_model_parallel_size > 1 and self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            # Megatron warns here too; MoELayer refuses the training forward (evaluation and inference are fine).
            warn_once(
                "expert and tensor parallelism without sequence parallelism can evaluate and generate but not train "
                "an MoE model; set sequence_parallel=True (--sequence-parallel) for training"
            )


def _validate_parallel_sizes(config: ModelParallelConfig) -> None:
    # The world size is not known here: only the sizes themselves are checked. expert_tensor_parallel_size is left
    # out, as it may still be None (derived from tensor_model_parallel_size afterwards).
    check_layout(
        None,
        tp=config.tensor_model_parallel_size,
        pp=config.pipeline_model_parallel_size,
        cp=config.context_parallel_size,
        ep=config.expert_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
    )
    if config.sequence_parallel and config.tensor_model_parallel_size == 1:
        raise ValueError(
            "sequence_parallel=True needs tensor_model_parallel_size > 1 (got 1); "
            "turn sequence_parallel off or raise tensor_model_parallel_size"
        )


def _validate_tp_comm_overlap(config: ModelParallelConfig) -> None:
    # Megatron-LM refuses --tp-comm-overlap without --sequence-parallel (which it turns off at TP 1).
    if not config.tp_comm_overlap:
        return
    if config.tensor_model_parallel_size == 1:
        raise ValueError(
            "tp_comm_overlap=True has nothing to overlap at tensor_model_parallel_size=1 (it hides the "
            "tensor-parallel all-gathers and reduce-scatters behind GEMMs); turn tp_comm_overlap off or raise "
            "tensor_model_parallel_size"
        )
    if not config.sequence_parallel:
        raise ValueError(
            "tp_comm_overlap=True needs sequence_parallel=True (it overlaps the sequence-parallel all-gathers and "
            "reduce-scatters with the GEMMs); turn sequence_parallel on or tp_comm_overlap off"
        )


def _validate_precision(config: ModelParallelConfig) -> None:
    if config.fp16 and config.bf16:
        raise ValueError("fp16 and bf16 are both set; choose one")
