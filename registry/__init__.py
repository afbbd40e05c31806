"""nki_autotune.registry: ops, impls, backends, dispatch, switches, tables and profiles."""

from . import cpu as _cpu  # noqa: F401  (registers the cpu backend)
from . import neuron as _neuron  # noqa: F401  (registers the neuron backend)
from .backend import Backend, backends, default_backend, get_backend, register_backend
from .dispatch import (
    Explanation,
    call,
    check_switches,
    explain,
    load_tables,
    reload_settings,
    resolve,
    scope,
    tables,
)
from .ops import Impl, Op, get_op, ops, register_impl, register_op
from .profile import Profile, ProfileError, Site, load_profile
from .recorder import Recorder, autostart, record
from .settings import Settings, SettingsError, settings, switch_variables
from .specs import INFERENCE, MODES, TRAINING, Key, TensorSpec
from .table import Entry, Table, TableError, load_table
from .yamlio import FormatError

__all__ = [
    "Backend", "Entry", "Explanation", "FormatError", "INFERENCE", "Impl", "Key", "MODES", "Op", "Settings",
    "SettingsError", "TRAINING", "Table", "TableError", "TensorSpec", "backends", "call", "check_switches",
    "default_backend", "explain", "get_backend", "get_op", "load_table", "load_tables", "ops",
    "register_backend", "register_impl", "register_op", "reload_settings", "resolve", "scope", "settings",
    "switch_variables", "tables", "Profile", "ProfileError", "Site", "load_profile", "Recorder", "record",
]

autostart()
