"""Where Megatron's users import a name from, when our code keeps it in another module.

Megatron-Core and Megatron-LM define some names in modules that sit low in their import graph but need groups or
models from higher up (``megatron.core.utils.get_batch_on_this_cp_rank``), or in large modules we split
(``megatron.training.training.get_model``). We keep each such name with the code that owns it and leave the old
module importing it back (or looking it up through its ``_MOVED`` table). ``@public_api(module)`` records the public
module as the name's ``__module__``, as NumPy's ``set_module`` does, so that ``help()``, pickles and API listings
name the path users import from, not our internal layout.
"""

from types import ModuleType


def public_api(module: str):
    """Decorator: the function or class is public at ``module`` (which must import it or list it in ``_MOVED``)."""

    def mark(obj):
        obj.__module__ = module
        return obj

    return mark


def public_names(namespace: dict, moved) -> list:
    """``__all__`` for a module with a ``_MOVED`` table: its public names plus the moved ones.

    A moved name exists only through the module's ``__getattr__``, so without ``__all__`` a star import or an API
    listing (which reads the module's namespace) would not see it. Call it last in the module: ``__all__ =
    public_names(globals(), _MOVED)``.
    """
    own = {name for name, value in namespace.items() if not name.startswith("_") and not isinstance(value, ModuleType)}
    return sorted(own | set(moved))
