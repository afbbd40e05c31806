"""nki_autotune.registry: ops, impls, backends, dispatch, switches, tables and profiles.

The plain-data parts (keys, tables, profiles, settings, source hashes) import neither torch nor numba, so
``nki-autotune show`` and ``diff`` stay light; the rest is imported on first use of one of its names.
"""

from importlib import import_module
from typing import Any

from .env import Settings, SettingsError, switch_variables
from .profile import Profile, ProfileError, Site, load_profile
from .specs import INFERENCE, MODES, TRAINING, Key, TensorSpec
from .table import Entry, Table, TableError, load_table
from .yamlio import FormatError

_TORCH_SIDE = {
    "Backend": "backend", "backends": "backend", "default_backend": "backend", "get_backend": "backend",
    "register_backend": "backend",
    "Explanation": "precedence",
    "call": "dispatch", "explain": "dispatch", "integer": "callkey",
    "check_switches": "switches", "reload_settings": "switches", "scope": "switches", "settings": "switches",
    "tables": "switches",
    "Impl": "op", "Op": "op", "get_op": "op", "ops": "op", "register_impl": "op", "register_op": "op",
    "unregister_impl": "op",
    "Recorder": "recorder", "record": "recorder",
}


def __getattr__(name: str) -> Any:
    module = _TORCH_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import_module(".cpu", __name__)  # the backends register themselves
    import_module(".neuron", __name__)
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Backend", "Entry", "Explanation", "FormatError", "INFERENCE", "Impl", "Key", "MODES", "Op", "Profile",
    "ProfileError", "Recorder", "Settings", "SettingsError", "Site", "TRAINING", "Table", "TableError", "TensorSpec",
    "backends", "call", "check_switches", "default_backend", "explain", "get_backend", "get_op", "integer",
    "load_profile", "load_table", "ops", "record", "register_backend", "register_impl", "register_op",
    "reload_settings", "scope", "settings", "switch_variables", "tables", "unregister_impl",
]
