"""Reading the pickled parts of a checkpoint without trusting them.

Every pickled byte stream of a checkpoint (the common state, ShardedObjects, a legacy ``common.pt``) is read with
``torch.load(..., weights_only=True)`` after :func:`megatron.core.safe_globals.register_safe_globals`, and DCP's
``.metadata`` with :class:`megatron.core.safe_globals.SafeUnpickler`. A class outside the allow-list is refused (its
code never runs) with an error naming the class and the file; anything unreadable is reported as corrupt.
"""

import pickle
import re
from typing import IO, Any, Union

import torch

from .core import CheckpointingException

# torch says "Unsupported global: GLOBAL a.B was not an allowed global" or "unsupported GLOBAL os.system whose module
# posix is blocked"; SafeUnpickler says "Refusing to unpickle disallowed class 'a.B'".
_UNSUPPORTED_GLOBAL = re.compile(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)|disallowed class '([\w.]+)'")
_GENERIC_ADVICE = ("Weights only load failed", "Check the documentation", "(1)", "(2)")


class CorruptCheckpointError(CheckpointingException):
    """A pickled part of a checkpoint cannot be read (truncated, overwritten, not a pickle)."""


def _reason(error: BaseException) -> str:
    """The informative line of an unpickling error (torch's weights-only errors start with generic advice)."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", str(error)) if p.strip()]
    specific = [p for p in paragraphs if not p.startswith(_GENERIC_ADVICE)] or paragraphs
    if not specific:
        return type(error).__name__
    line = specific[0].splitlines()[0].replace("WeightsUnpickler error: ", "")
    return f"{type(error).__name__}: {line[:200]}"


def refused_global(error: BaseException):
    """The ``module.name`` an allow-listed unpickler refused, or None when ``error`` is something else."""
    match = _UNSUPPORTED_GLOBAL.search(str(error))
    return (match.group(1) or match.group(2)) if match else None


def _refusal(name: str, what: str) -> CheckpointingException:
    return CheckpointingException(
        f"{what} holds an object of {name}, which is not in the allow-list of megatron.core.safe_globals; it was "
        "not loaded (unpickling it could run arbitrary code). If you trust this checkpoint and the class is "
        f"harmless, allow it with torch.serialization.add_safe_globals([{name}]) before loading"
    )


def safe_torch_load(source: Union[str, IO[bytes]], what: str) -> Any:
    """``torch.load(source, weights_only=True)`` with the allow-list registered; ``what`` names the source in errors
    (e.g. "the common state in <file> of checkpoint <dir>")."""
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:
        name = refused_global(error)
        if name is not None:
            raise _refusal(name, what) from None
        raise CorruptCheckpointError(f"{what} is corrupt or truncated ({_reason(error)})") from error


def safe_pickle_load(file: IO[bytes], what: str) -> Any:
    """A plain pickle read with :class:`~megatron.core.safe_globals.SafeUnpickler`; errors as in
    :func:`safe_torch_load`."""
    from megatron.core.safe_globals import SafeUnpickler

    try:
        return SafeUnpickler(file).load()
    except Exception as error:
        name = refused_global(error)
        if name is not None:
            raise _refusal(name, what) from None
        if isinstance(error, (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError)):
            raise CorruptCheckpointError(f"{what} is corrupt ({_reason(error)})") from error
        raise
