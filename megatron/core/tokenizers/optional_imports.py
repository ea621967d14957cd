"""Import the optional tokenizer libraries only when a tokenizer needs them, with an error naming the pip package."""

import importlib


def import_optional(module_name: str, pip_package: str, needed_for: str):
    """Import `module_name`, or raise ImportError telling the user which pip package provides it."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(
            f"{needed_for} needs the `{module_name}` module: pip install {pip_package} "
            f"(or pip install 'megatron-lite[tokenizers]')"
        ) from error
