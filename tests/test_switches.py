"""The switches of docs/design.md §4: values, precedence, errors that name the variable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import nki_autotune.kernels as nk
from nki_autotune.registry import Entry, SettingsError, explain, get_op, reload_settings, scope, settings
from nki_autotune.registry.env import read_settings

from .conftest import rmsnorm_key


def _xw(rows=8, d=64):
    return torch.randn(rows, d), torch.randn(d)


@pytest.mark.parametrize("raw, want", [
    ("auto", "auto"), ("off", "off"), ("on", "on"), ("0", "off"), ("false", "off"), ("No", "off"),
    ("1", "on"), ("TRUE", "on"), ("yes", "on"), (" on ", "on"),
])
def test_global_values(raw, want):
    assert read_settings({"NKI_AUTOTUNE_KERNELS": raw}).kernels == want


def test_defaults():
    s = read_settings({})
    assert (s.kernels, dict(s.per_op), s.tables, s.strict, s.record) == ("auto", {}, (), False, None)


def test_the_study_folder_is_the_processs_user_cache_under_any_switches(tmp_path, monkeypatch):
    """The default study storage's folder is not a switch: scoped switches keep the process's XDG_CACHE_HOME."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with scope(NKI_AUTOTUNE_KERNELS="off"):
        assert settings().cache_dir == str(tmp_path / "nki-autotune")
    assert read_settings({"XDG_CACHE_HOME": "/elsewhere"}).cache_dir == "/elsewhere/nki-autotune"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert read_settings({}).cache_dir == os.path.expanduser("~/.cache/nki-autotune")


@pytest.mark.parametrize("var, raw", [
    ("NKI_AUTOTUNE_KERNELS", "maybe"),
    ("NKI_AUTOTUNE_KERNELS", "cpu_rows"),  # impl names are per-op only
    ("NKI_AUTOTUNE_KERNEL_RMSNORM", "fast!"),
    ("NKI_AUTOTUNE_STRICT", "sometimes"),
])
def test_invalid_values_name_the_variable_and_the_allowed_values(var, raw):
    with pytest.raises(SettingsError) as e:
        read_settings({var: raw})
    assert var in str(e.value) and repr(raw) in str(e.value)
    assert "auto" in str(e.value) or "use 1 (or true, yes, on) or 0 (or false, no, off)" in str(e.value)


@pytest.mark.parametrize("var", ["NKI_AUTOTUNE_KERNAL", "NKI_AUTOTUNE_LGO", "NKI_AUTOTUNE_TABLES"])
def test_a_misspelt_variable_is_named_not_ignored(var):
    """Else its switch stays at the default: ``scope(NKI_AUTOTUNE_KERNAL="on")`` would run every kernel off."""
    with pytest.raises(SettingsError, match=f"{var} is not a variable of nki-autotune; it reads NKI_AUTOTUNE_KERNELS"):
        read_settings({var: "on"})
    with pytest.raises(SettingsError, match=var), scope(**{var: "on"}):
        pass
    assert read_settings({"NKI_AUTOTUNE_KERNEL_RMSNORM": "off", "OTHER_TOOL_KERNAL": "on"}).per_op == {"rmsnorm": "off"}


def test_unknown_impl_and_unknown_op_are_rejected_on_reload():
    with pytest.raises(SettingsError, match="NKI_AUTOTUNE_KERNEL_RMSNORM='nki_fast'.*cpu_rows"):
        reload_settings({"NKI_AUTOTUNE_KERNEL_RMSNORM": "nki_fast"})
    with pytest.raises(SettingsError, match="NKI_AUTOTUNE_KERNEL_LAYERNORM names no registered op"):
        reload_settings({"NKI_AUTOTUNE_KERNEL_LAYERNORM": "on"})
    assert settings().per_op == {}  # a rejected reload changes nothing


def test_settings_are_read_once(switches, monkeypatch):
    switches(NKI_AUTOTUNE_KERNELS="off")
    monkeypatch.setenv("NKI_AUTOTUNE_KERNELS", "on")  # not seen until reload_settings()
    x, w = _xw()
    assert explain("rmsnorm", x, w).path == "compiler"
    reload_settings()
    assert explain("rmsnorm", x, w).path == "kernel"


def _kernel_entry(shape, mode="inference"):
    return Entry(rmsnorm_key(shape, mode), "cpu_rows", {"threads": 1, "rows_per_task": 4}, reason="faster")


def _compiler_entry(shape, mode="inference"):
    return Entry(rmsnorm_key(shape, mode), None, reason="slower")


# (global, per-op, table says) -> expected path and impl config source
PRECEDENCE = [
    # no switches: the table decides
    ({}, "kernel", "kernel"),
    ({}, "compiler", "compiler"),
    ({}, None, "compiler"),
    # global switch over the table
    ({"NKI_AUTOTUNE_KERNELS": "off"}, "kernel", "compiler"),
    ({"NKI_AUTOTUNE_KERNELS": "on"}, "compiler", "kernel"),
    ({"NKI_AUTOTUNE_KERNELS": "on"}, None, "kernel"),
    ({"NKI_AUTOTUNE_KERNELS": "auto"}, "kernel", "kernel"),
    # per-op switch over the global one
    ({"NKI_AUTOTUNE_KERNELS": "off", "NKI_AUTOTUNE_KERNEL_RMSNORM": "on"}, None, "kernel"),
    ({"NKI_AUTOTUNE_KERNELS": "on", "NKI_AUTOTUNE_KERNEL_RMSNORM": "off"}, "kernel", "compiler"),
    ({"NKI_AUTOTUNE_KERNELS": "on", "NKI_AUTOTUNE_KERNEL_RMSNORM": "auto"}, "compiler", "compiler"),
    ({"NKI_AUTOTUNE_KERNELS": "off", "NKI_AUTOTUNE_KERNEL_RMSNORM": "auto"}, "kernel", "kernel"),
    ({"NKI_AUTOTUNE_KERNELS": "off", "NKI_AUTOTUNE_KERNEL_RMSNORM": "cpu_rows"}, "compiler", "kernel"),
]


@pytest.mark.parametrize("env, table_says, want", PRECEDENCE)
def test_precedence(switches, write_table, env, table_says, want):
    shape = (8, 64)
    entries = {"kernel": [_kernel_entry(shape)], "compiler": [_compiler_entry(shape)], None: []}[table_says]
    switches(NKI_AUTOTUNE_TABLE=write_table(entries), **env)
    x, w = _xw(*shape)
    exp = explain("rmsnorm", x, w)
    assert exp.path == want, exp
    var = "NKI_AUTOTUNE_KERNEL_RMSNORM" if "NKI_AUTOTUNE_KERNEL_RMSNORM" in env else "NKI_AUTOTUNE_KERNELS"
    if env and env.get(var) != "auto":
        assert var in exp.reason
    # the call itself takes the explained path: the forced-off path is the reference bit for bit
    y = nk.rmsnorm(x, w)
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)


def test_on_uses_the_table_config_when_the_table_names_the_impl(switches, write_table, monkeypatch):
    switches(NKI_AUTOTUNE_TABLE=write_table([_kernel_entry((8, 64))]), NKI_AUTOTUNE_KERNELS="on")
    exp = explain("rmsnorm", *_xw(8, 64))
    assert dict(exp.config) == {"threads": 1, "rows_per_task": 4}
    exp = explain("rmsnorm", *_xw(16, 64))  # no entry: the impl's default config
    assert exp.path == "kernel" and "default config" in exp.reason
    impl = get_op("rmsnorm").impls["cpu_rows"]
    exp = explain("rmsnorm", *_xw(1, 64))  # one row: the default fitted to the call, on one thread
    assert exp.config["threads"] == 1 and "default config" in exp.reason, exp.reason
    monkeypatch.setattr(impl, "fit", None)
    exp = explain("rmsnorm", *_xw(1, 64))  # unfitted, the default's two threads have one task between them
    assert not impl.allows(impl.default, exp.key) and impl.allows(dict(exp.config), exp.key)
    assert exp.path == "kernel" and "the first config its constraint admits" in exp.reason, exp.reason
    assert "default config" not in exp.reason


def test_forced_impl_that_declines_takes_the_compiler_path(switches):
    switches(NKI_AUTOTUNE_KERNEL_RMSNORM="cpu_rows")
    x, w = _xw()
    exp = explain("rmsnorm", x.double(), w.double())
    assert exp.path == "compiler" and "cpu_rows declines" in exp.reason


def test_table_mode_must_match(switches, write_table):
    switches(NKI_AUTOTUNE_TABLE=write_table([_kernel_entry((8, 64), mode="training")]))
    x, w = _xw()
    assert explain("rmsnorm", x, w).path == "compiler"  # an inference call
    x.requires_grad_()
    frozen = explain("rmsnorm", x, w)  # training, but the weight is frozen: another key
    assert frozen.path == "compiler" and "differs in gradient of input 1" in frozen.reason, frozen.reason
    assert explain("rmsnorm", x, w.requires_grad_()).path == "kernel"
    with torch.no_grad():
        assert explain("rmsnorm", x, w).path == "compiler"


def test_first_table_wins(switches, write_table):
    a = write_table([_kernel_entry((8, 64))], name="a.yaml")
    b = write_table([_compiler_entry((8, 64))], name="b.yaml")
    import os

    switches(NKI_AUTOTUNE_TABLE=os.pathsep.join([a, b]))
    assert explain("rmsnorm", *_xw()).path == "kernel"
    switches(NKI_AUTOTUNE_TABLE=os.pathsep.join([b, a]))
    assert explain("rmsnorm", *_xw()).path == "compiler"


USER_IMPL = '''
import torch
from nki_autotune.registry import Impl, get_op, register_impl

def forward(tensors, attrs, config):
    x, w = tensors
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + attrs["eps"]) * w, torch.empty(x.shape[:-1]))

register_impl(Impl(op=get_op("rmsnorm"), name="mine", backend="cpu", forward=forward,
                   fake=lambda t, a: (torch.empty_like(t[0]), t[0].new_empty(t[0].shape[:-1])),
                   supports=lambda specs, attrs: None, saved=1))
'''


@pytest.mark.parametrize("switch", ["table", "per-op switch"])
def test_a_user_impl_of_a_pack_op_is_named_before_its_module_registers_it(tmp_path, switch):
    """The pack reads tables and switches at import, before a user's module can register an impl of one of its
    ops: the impl is found once registered; an entry whose impl is never registered is ignored, with a warning."""
    from nki_autotune.registry import Table, get_backend

    (tmp_path / "myimpl.py").write_text(USER_IMPL)
    table = tmp_path / "t.yaml"
    Table(get_backend("cpu").fingerprint(), [Entry(rmsnorm_key((4, 8), mode="inference"), "mine")]).save(table)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NKI_AUTOTUNE_")}
    env["PYTHONPATH"] = str(tmp_path)
    if switch == "table":
        env["NKI_AUTOTUNE_TABLE"] = str(table)
    else:
        env["NKI_AUTOTUNE_KERNEL_RMSNORM"] = "mine"
    code = textwrap.dedent("""
        import sys, warnings
        import torch
        import nki_autotune.kernels as nk
        from nki_autotune.registry import explain
        x, w = torch.randn(4, 8), torch.ones(8)
        if sys.argv[1] == "import":
            import myimpl
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                nk.rmsnorm(x, w)
            print("PATH", explain("rmsnorm", x, w).impl, "WHY", explain("rmsnorm", x, w).reason)
        print("WARN", " | ".join(str(c.message) for c in caught))
    """)
    run = [sys.executable, "-c", code]
    r = subprocess.run([*run, "import"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "PATH mine" in r.stdout
    if switch == "table":
        r = subprocess.run([*run, "no"], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "PATH None" in r.stdout and "entries[0] names impl rmsnorm.mine" in r.stdout
        assert "entries[0] names impl rmsnorm.mine, which is not registered: ignored" in r.stdout.split("WHY")[1]
        r = subprocess.run([*run, "no"], capture_output=True, text=True, env={**env, "NKI_AUTOTUNE_STRICT": "1"},
                           cwd=tmp_path)
        assert r.returncode != 0 and "entries[0] names impl rmsnorm.mine" in r.stderr and "TableError" in r.stderr
