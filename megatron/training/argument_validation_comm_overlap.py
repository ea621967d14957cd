"""Tensor-parallel communication-overlap part of ``validate_args``: ``--tp-comm-overlap`` and its userbuffers file,
checked before any process group exists.

The overlap itself is ``megatron.core.tensor_parallel.comm_overlap``. As in Megatron-LM, it needs
``--sequence-parallel`` (the collectives it hides are the sequence-parallel all-gathers and reduce-scatters), which
Megatron-LM turns off at ``--tensor-model-parallel-size 1``: there is nothing to overlap there.
``--tp-comm-overlap-cfg`` is Transformer Engine's userbuffers YAML (per-GEMM methods, SM counts, CGA sizes, atomic
GEMMs): it tunes GPU kernels this build does not run, so a launch script that passes one still runs, told once that
the file is not used; a path that does not exist is refused as Megatron-LM would when opening it.
"""

import os

from megatron.core.utils import warn_once


def validate_tp_comm_overlap_args(args) -> None:
    """Check ``--tp-comm-overlap`` and ``--tp-comm-overlap-cfg`` (see the module docstring)."""
    if not args.tp_comm_overlap:
        return  # Megatron-LM reads the userbuffers file only with --tp-comm-overlap
    if args.tensor_model_parallel_size == 1:
        raise ValueError(
            "--tp-comm-overlap has nothing to overlap with --tensor-model-parallel-size 1 (it hides the "
            "tensor-parallel all-gathers and reduce-scatters behind the GEMMs); drop --tp-comm-overlap or raise "
            "--tensor-model-parallel-size"
        )
    if not args.sequence_parallel:
        raise ValueError(
            "--tp-comm-overlap needs --sequence-parallel: it overlaps the sequence-parallel all-gathers and "
            "reduce-scatters with the GEMMs; add --sequence-parallel or drop --tp-comm-overlap"
        )
    if getattr(args, "fp8", None) is not None:
        raise ValueError(
            f"--tp-comm-overlap with --fp8-format {args.fp8}: the overlapped GEMMs do not run in FP8 yet; drop "
            "--tp-comm-overlap to train in FP8, or --fp8-format to overlap"
        )
    cfg = args.tp_comm_overlap_cfg
    if cfg is None:
        return
    if not os.path.isfile(cfg):
        raise ValueError(f"--tp-comm-overlap-cfg {cfg}: no such file (a Transformer Engine userbuffers YAML)")
    warn_once(
        f"--tp-comm-overlap-cfg {cfg} tunes Transformer Engine's userbuffers kernels, which this build does not "
        "use: the file is not read; --tp-comm-overlap runs with asynchronous collectives in sequence chunks"
    )
