"""Memory-history recording for ``--record-memory-history`` (a snapshot of every allocation, viewable in PyTorch's
memory visualiser)."""

from megatron.core.utils import cuda_available, warn_once


def start_memory_history_recording(max_entries=100000) -> bool:
    """Start recording the accelerator's allocation history (up to ``max_entries`` events); returns whether it
    started. PyTorch records it for CUDA memory only; elsewhere it warns once and returns False."""
    if not cuda_available():
        warn_once(
            "--record-memory-history: PyTorch records allocation history for CUDA memory only; "
            "nothing is recorded on this device"
        )
        return False
    import torch.cuda.memory

    torch.cuda.memory._record_memory_history(max_entries=max_entries)
    return True
