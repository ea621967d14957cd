"""The exception every dist_checkpointing error raises, and the ``metadata.json`` that marks a checkpoint directory."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

CONFIG_FNAME = "metadata.json"


class CheckpointingException(Exception):
    """A sharded state dict, a checkpoint directory or a request to save/load it is invalid."""


@dataclass
class CheckpointingConfig:
    """What ``metadata.json`` records: which backend wrote the shards, and its format version. (Checkpoints of
    earlier versions also name a ``common_backend`` for their ``common.pt``; reading ignores it.)"""

    sharded_backend: str
    sharded_backend_version: int = 1


def check_is_distributed_checkpoint(checkpoint_dir: Union[str, Path]) -> bool:
    """True when ``checkpoint_dir`` holds a distributed checkpoint (it has a ``metadata.json``)."""
    return maybe_load_config(checkpoint_dir) is not None


def maybe_load_config(checkpoint_dir: Union[str, Path]) -> Optional[CheckpointingConfig]:
    """The checkpoint's config, or None when ``checkpoint_dir`` has no ``metadata.json``."""
    config_path = Path(checkpoint_dir) / CONFIG_FNAME
    if not config_path.exists():
        return None
    return parse_config(config_path.read_bytes(), config_path)


def parse_config(content: bytes, config_path: Union[str, Path]) -> CheckpointingConfig:
    """The config a ``metadata.json`` holding ``content`` describes; raises, naming the file, when it is not one."""
    expected = 'JSON like {"sharded_backend": "torch_dist", "sharded_backend_version": 1}'
    try:
        fields = json.loads(content)
    except ValueError as error:
        raise CheckpointingException(f"{config_path} is not valid JSON ({error}); expected {expected}") from error
    if not isinstance(fields, dict) or not isinstance(fields.get("sharded_backend"), str):
        raise CheckpointingException(f"{config_path} names no sharded_backend; expected {expected}")
    known = {name: fields[name] for name in CheckpointingConfig.__dataclass_fields__ if name in fields}
    return CheckpointingConfig(**known)


def save_config(config: CheckpointingConfig, checkpoint_dir: Union[str, Path]) -> None:
    """Write ``metadata.json`` (the marker that the sharded data of ``checkpoint_dir`` is complete)."""
    with open(Path(checkpoint_dir) / CONFIG_FNAME, "w") as f:
        json.dump(asdict(config), f)
