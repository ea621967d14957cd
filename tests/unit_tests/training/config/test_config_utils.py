"""sanitize_dataclass_config drops init=False fields saved by older writers, for allow-listed targets only."""

import logging
from dataclasses import dataclass, field

from megatron.training.config.instantiate_utils import target_allowlist
from megatron.training.config.utils import _resolve_target_class, sanitize_dataclass_config


@dataclass
class Computed:
    name: str = "x"
    derived: str = field(init=False, default="")


def test_drops_init_false_fields_in_nested_dicts_and_lists():
    target_allowlist.add_exact(f"{__name__}.Computed")
    try:
        saved = {
            "model": {"_target_": f"{__name__}.Computed", "name": "m", "derived": "stale"},
            "items": [{"_target_": f"{__name__}.Computed", "derived": "stale"}, 3],
        }
        clean = sanitize_dataclass_config(saved)
    finally:
        target_allowlist.remove_exact(f"{__name__}.Computed")
    assert clean["model"] == {"_target_": f"{__name__}.Computed", "name": "m"}
    assert clean["items"] == [{"_target_": f"{__name__}.Computed"}, 3]
    assert saved["model"]["derived"] == "stale"  # the input is left alone


def test_unlisted_target_is_not_imported_and_keeps_its_keys(caplog):
    config = {"_target_": f"{__name__}.Computed", "name": "y", "derived": "stale"}
    with caplog.at_level(logging.WARNING):
        assert sanitize_dataclass_config(config) == config
        assert _resolve_target_class("untrusted_pkg_xyz.Thing") is None
    assert "Not resolving _target_ 'untrusted_pkg_xyz.Thing': it is not in the allowlist" in caplog.text


def test_unresolvable_allowed_target_warns(caplog):
    with caplog.at_level(logging.WARNING):
        assert _resolve_target_class("megatron.core.no_such_module.Thing") is None
    assert "Could not resolve _target_ 'megatron.core.no_such_module.Thing'" in caplog.text
