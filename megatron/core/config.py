"""Process-wide switches of Megatron-Core (``megatron.core.config``): whether experimental APIs may be used."""

ENABLE_EXPERIMENTAL = False


def set_experimental_flag(flag: bool) -> None:
    """Allow (True) or forbid (False) calling APIs marked with ``megatron.core.utils.experimental_api``."""
    global ENABLE_EXPERIMENTAL
    ENABLE_EXPERIMENTAL = bool(flag)


def is_experimental_enabled() -> bool:
    return ENABLE_EXPERIMENTAL
