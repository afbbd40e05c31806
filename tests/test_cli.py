"""The nki-autotune command: each subcommand, its output and its exit codes (0 ok, 1 failed work, 2 bad input)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from nki_autotune.registry import get_backend, load_table, ops

from .test_profile import GOOD


def cli(*args, cwd=None, env=None):
    full_env = {**os.environ, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if not k.startswith("NKI_AUTOTUNE_") or k in (env or {})}
    return subprocess.run([sys.executable, "-m", "nki_autotune.autotune", *args], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=600)


def here(*args, cwd=None) -> subprocess.CompletedProcess:
    """The command run in this process, as ``cli`` reports it (exit code, output): where the process itself is not
    what a test is about, without a second interpreter's import of torch and the pack (5-7 s of CPU). Its
    environment is this process's (``monkeypatch``, the ``switches`` fixture); the console script's own path, the
    switches read at import, is ``test_bad_switch_value_exits_2``'s. ``run`` and ``check`` still start their
    worker process."""
    from nki_autotune.autotune.cli import main

    out, err, back = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd or back)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    finally:
        os.chdir(back)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def cli_here(*args) -> int:
    """``here``'s exit code, its output to pytest's capture (``capsys``)."""
    r = here(*args)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr)
    return r.returncode


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    prof = d / "profile.yaml"
    prof.write_text(yaml.safe_dump({"version": 1, "sites": [
        # large enough that the compiler's region is measurably slower than an empty one on a busy machine too
        {**GOOD, "site": "m.a",
         "inputs": [{"shape": [64, 512], "dtype": "float32"}, {"shape": [512], "dtype": "float32"}]},
        {**GOOD, "site": "m.b", "inputs": [{"shape": [4, 8], "dtype": "float64"}, {"shape": [8], "dtype": "float64"}]},
    ]}))
    out = d / "dispatch.yaml"
    # --pause 0: on a busy machine (the other test worker compiling) the final comparison is measured again at once
    r = here("run", prof, "-o", out, "--backend", "cpu", "--trials", "2", "--rounds", "3", "--final-rounds", "6",
             "--pause", "0", "--storage", f"sqlite:///{d}/s.db")
    return d, prof, out, r


def test_run_writes_a_table_and_a_summary(tuned):
    d, prof, out, r = tuned
    assert r.returncode == 0, r.stderr
    assert "dispatch table" in r.stdout and "speedup" in r.stdout and "wrote" in r.stdout
    table = load_table(out, ops())
    assert len(table.entries) == 2
    f64 = [e for e in table.entries if e.key.inputs[0].dtype == "float64"][0]
    assert f64.impl is None and "declines" in f64.reason
    f32 = [e for e in table.entries if e.key.inputs[0].dtype == "float32"][0]
    r2 = here("run", prof, "-o", d / "again.yaml", "--backend", "cpu", "--trials", "2", "--rounds", "3",
              "--final-rounds", "6", "--retries", "0", "--pause", "0", "--storage", f"sqlite:///{d}/s.db")
    assert r2.returncode == 0, r2.stderr
    if (f32.measured.get("calibration") or {}).get("disturbed"):  # a busy machine: the next run measures it again
        assert "nothing measured" not in r2.stdout, r2.stdout
    else:  # a quiet one: everything comes from storage, and so does the table
        assert "nothing measured" in r2.stdout, r2.stdout
        assert [(e.impl, e.config) for e in load_table(d / "again.yaml", ops()).entries] == \
            [(e.impl, e.config) for e in table.entries]


def test_a_run_cut_short_by_its_budget_says_so(tuned):
    d, prof, _, _ = tuned
    r = here("run", prof, "-o", d / "cut.yaml", "--budget", "0", "--backend", "cpu",
             "--storage", f"sqlite:///{d}/cut.db")
    assert r.returncode == 0, r.stderr
    assert "the --budget ran out before 1 of them were decided" in " ".join(r.stdout.split()), r.stdout
    reasons = [e.reason for e in load_table(d / "cut.yaml", ops()).entries]
    assert sum("budget exhausted before any trial ran" in x for x in reasons) == 1, reasons
    # over a finished table, a cut run writes nothing: the table it would replace is kept, as on an interrupt
    before = tuned[2].read_text()
    r = here("run", prof, "-o", tuned[2], "--budget", "0", "--backend", "cpu",
             "--storage", f"sqlite:///{d}/cut2.db")
    assert r.returncode == 1 and "dispatch.yaml is left as it was" in " ".join(r.stdout.split()), r.stdout
    assert tuned[2].read_text() == before
    # over a table cut short itself, a cut run writes its own (it may have decided more)
    marked = (d / "cut.yaml").read_text().replace("budget exhausted before any trial ran", "budget exhausted (old)")
    assert "(old)" in marked
    (d / "cut.yaml").write_text(marked)
    r = here("run", prof, "-o", d / "cut.yaml", "--budget", "0", "--backend", "cpu",
             "--storage", f"sqlite:///{d}/cut3.db")
    assert r.returncode == 0 and "(old)" not in (d / "cut.yaml").read_text(), r.stdout


def test_show_and_diff(tuned):
    d, _, out, _ = tuned
    r = here("show", out)
    assert r.returncode == 0 and "fingerprint: backend=cpu" in r.stdout and "declines" in r.stdout
    i, timed = next((i, e) for i, e in enumerate(load_table(out, ops()).entries) if "speedup" in e.measured)
    peaks = [f"{timed.measured[f'{side}_peak_mib']:g}" for side in ("kernel", "compiler")]
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"│ {i} "))
    assert "kernel MiB" in r.stdout and "compiler MiB" in r.stdout and all(f" {p} " in row for p in peaks), r.stdout
    other = yaml.safe_load(out.read_text())
    other["entries"][0]["choice"] = {"impl": "cpu_rows", "config": {"threads": 1, "rows_per_task": 4}} \
        if other["entries"][0]["choice"] == "compiler" else "compiler"
    (d / "other.yaml").write_text(yaml.safe_dump(other))
    r = here("diff", out, d / "other.yaml")
    assert r.returncode == 0 and "1 decision(s) changed" in r.stdout


def test_list_shows_ops_backends_and_switches(switches):
    switches(NKI_AUTOTUNE_KERNEL_RMSNORM="off")
    r = here("list")
    assert r.returncode == 0
    assert "cpu_rows" in r.stdout and "rows_per_task" in r.stdout
    assert "neuron" in r.stdout and (get_backend("neuron").available() or "unavailable" in r.stdout)
    assert "NKI_AUTOTUNE_KERNEL_RMSNORM" in r.stdout and "off" in r.stdout
    assert "NKI Library" in r.stdout  # its impls where nkilib imports, else why none (test_nkilib_impls.py)


def test_check_passes():
    """One op's impls, native and simulated (every impl's numerics: test_pack.py, test_rmsnorm.py, test_pack_nki.py)."""
    r = here("check", "--ops", "rmsnorm")
    assert r.returncode == 0, r.stdout
    assert "rmsnorm.cpu_rows" in r.stdout and "FAIL" not in r.stdout and " 0 failed" in r.stdout
    assert "rmsnorm.nki_tiled" in r.stdout and ("simulated" in r.stdout or get_backend("neuron").available())


def test_record_runs_a_command_and_writes_its_profile(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import nki_autotune.kernels as nk
        nk.rmsnorm(torch.randn(2, 16), torch.ones(16))
    """))
    r = here("record", "-o", str(tmp_path / "p.yaml"), "--", sys.executable, str(script), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1 call sites, 1 unique keys" in r.stdout
    r = here("record", "-o", str(tmp_path / "q.yaml"), "--", sys.executable, "-c", "pass")
    assert r.returncode == 1 and "no profile was written" in r.stdout
    r = here("record", "-o", str(tmp_path / "q.yaml"), "--", sys.executable, "-c", "raise SystemExit(3)")
    assert r.returncode == 1 and "exited with code 3" in r.stdout
    before = (tmp_path / "p.yaml").read_text()  # a run that records nothing, or fails, keeps the earlier profile
    for command in ("pass", "raise SystemExit(3)"):
        r = here("record", "-o", str(tmp_path / "p.yaml"), "--", sys.executable, "-c", command)
        assert r.returncode == 1 and "p.yaml is left as it was" in r.stdout
        assert (tmp_path / "p.yaml").read_text() == before
    r = here("record", "-o", str(tmp_path / "p.yaml"), "--", str(tmp_path / "no-such-program"))
    assert r.returncode == 2 and "cannot run" in r.stderr and "p.yaml is left as it was" in r.stderr
    assert (tmp_path / "p.yaml").read_text() == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_record_stopped_while_its_command_runs_puts_the_earlier_profile_back(tmp_path, sig):
    """``record`` started as a shell without job control starts a background job, SIGINT ignored (as ``make test``
    may be): a Ctrl-C or a SIGTERM still interrupts it, 130 / 143."""
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"version": 2, "sites": [GOOD]}))
    before = prof.read_text()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NKI_AUTOTUNE_")}
    proc = subprocess.Popen([sys.executable, "-m", "nki_autotune.autotune", "record", "-o", str(prof), "--",
                             sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 120
    while not (tmp_path / "p.yaml.before-record").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig and "interrupted" in err, (proc.returncode, out, err)
    assert prof.read_text() == before and not (tmp_path / "p.yaml.before-record").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_record_whose_command_dies_of_the_signal_first_is_interrupted(tmp_path, capsys, sig):
    """A Ctrl-C reaches the whole foreground group: the recorded command may die of it before ``record`` sees it."""
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"version": 2, "sites": [GOOD]}))
    before = prof.read_text()
    kill = f"import os, signal; signal.signal({int(sig)}, signal.SIG_DFL); os.kill(os.getpid(), {int(sig)})"
    assert cli_here("record", "-o", str(prof), "--", sys.executable, "-c", kill) == 128 + sig
    out, err = capsys.readouterr()
    assert "interrupted" in err and "no profile was written" not in out, (out, err)
    assert prof.read_text() == before and not (tmp_path / "p.yaml.before-record").exists()


@pytest.mark.parametrize("env", [{}, {"FORCE_COLOR": "1"}, {"TTY_COMPATIBLE": "1"}], ids=["plain", "FORCE_COLOR",
                                                                                        "TTY_COMPATIBLE"])
def test_output_that_is_not_a_terminal_is_never_wrapped(tmp_path, capsys, monkeypatch, env):
    """Logs keep each message and path on one line, however long the path (and whatever asks for colours)."""
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    deep = tmp_path / ("a-long-folder-name-" * 6) / ("another-long-folder-name-" * 6)
    deep.mkdir(parents=True)
    prof = deep / "p.yaml"
    prof.write_text(yaml.safe_dump({"version": 2, "sites": [GOOD]}))
    assert cli_here("record", "-o", str(prof), "--", sys.executable, "-c", "raise SystemExit(3)") == 1
    out = capsys.readouterr().out
    assert f"{prof} is left as it was" in out, out


TWICE = """
import torch
from nki_autotune.registry import Op, call, register_op

TWICE = register_op(Op(name="twice", reference=lambda x: 2 * x, tensors=("x",), differentiable=("x",),
                       make_inputs=lambda key, gen, samples=None: (torch.randn(key.inputs[0].shape, generator=gen),)))


def twice(x):
    return call(TWICE, (x,), ())
"""


def test_record_of_a_program_with_its_own_ops_names_import(tmp_path, monkeypatch):
    """A program that registers an op of its own records it; record itself needs that module (--import) to read
    the profile, says so, and keeps what the run wrote. (The record that imports it runs in a process of its own:
    the op is not registered in the tests' process.)"""
    (tmp_path / "twice.py").write_text(TWICE)
    (tmp_path / "train.py").write_text("import torch, twice\ntwice.twice(torch.randn(3, 5))\n")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(tmp_path), os.environ.get("PYTHONPATH"))))}
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])  # the recorded program's
    r = here("record", "-o", "p.yaml", "--", sys.executable, "train.py", cwd=tmp_path)
    assert r.returncode == 2 and "calls of twice" in r.stderr and "--import MODULE" in r.stderr
    assert "twice" in (tmp_path / "p.yaml").read_text()
    r = cli("record", "-o", "p.yaml", "--import", "twice", "--", sys.executable, "train.py", cwd=tmp_path, env=env)
    assert r.returncode == 0 and "1 call sites" in r.stdout, r.stderr
    assert [s["site"] for s in yaml.safe_load((tmp_path / "p.yaml").read_text())["sites"]] == ["train.py:2"]


@pytest.mark.parametrize("args, message", [
    (["run", "missing.yaml", "-o", "t.yaml"], "missing.yaml: cannot read profile"),
    (["run", "bad.yaml", "-o", "t.yaml"], "sites[0] (m.n): field 'op': unknown op 'layernorm'"),
    (["run", "good.yaml", "-o", "t.yaml", "--ops", "layernorm"], "--ops names unknown op(s) layernorm"),
    pytest.param(["run", "good.yaml", "-o", "t.yaml", "--backend", "neuron"], "backend neuron is not available here",
                 marks=pytest.mark.skipif(get_backend("neuron").available(),
                                          reason="the neuron backend is available on this host")),
    (["show", "bad.yaml"], "bad.yaml: a profile (it has 'sites'), not a dispatch table"),
    (["record", "-o", "p.yaml"], "record needs a command"),
    (["run", "good.yaml", "-o", "t.yaml", "--rounds", "0"], "argument --rounds: must be at least 3, got 0"),
    (["run", "good.yaml", "-o", "t.yaml", "--final-rounds", "5"], "argument --final-rounds: must be at least 6"),
    (["run", "good.yaml", "-o", "t.yaml", "--trials", "0"], "argument --trials: must be at least 1, got 0"),
    (["run", "good.yaml", "-o", "t.yaml", "--budget", "-5"], "argument --budget: must be at least 0.0, got -5"),
    (["run", "good.yaml", "-o", "t.yaml", "--trial-timeout", "0"], "argument --trial-timeout: must be above 0"),
    (["run", "good.yaml", "-o", "t.yaml", "--trial-timeout", "inf"], "argument --trial-timeout: must be a finite"),
    (["run", "good.yaml", "-o", "t.yaml", "--budget", "nan"], "argument --budget: must be a finite number"),
    (["run", "good.yaml", "-o", "t.yaml", "--bench-seconds", "-1"], "argument --bench-seconds: must be at least 0.0"),
    (["run", "good.yaml", "-o", "t.yaml", "--threshold", "inf"], "argument --threshold: must be a finite number"),
    (["run", "good.yaml", "-o", "t.yaml", "--threshold", "0.9"], "argument --threshold: must be at least 1.0"),
    (["show", "binary.yaml"], "binary.yaml: cannot read dispatch table: not UTF-8 text"),
    (["run", "good.yaml", "-o", "t.yaml", "--trials", "two"], "argument --trials: expected an integer, got 'two'"),
    (["run", "good.yaml", "-o", "t.yaml", "--storage", "bogus://x"], "--storage bogus://x: not a storage URL"),
    (["verify", "t.yaml", "s.py:f", "--rounds", "5"], "argument --rounds: must be at least 6, got 5"),
    (["run", "good.yaml", "-o", "adir"], "-o adir is a directory; name a file"),
    (["record", "-o", "adir", "--", sys.executable, "-c", "open('ran', 'w')"], "-o adir is a directory"),
    (["run", "sampled.yaml", "-o", "t.yaml"], "garbage.pt cannot be read (UnpicklingError"),
    (["verify", "t.yaml", "s.py:f", "-o", "p.yaml"], "-o OUT writes the pruned table: it needs --prune"),
    (["run", "table.yaml", "-o", "t.yaml"], "table.yaml: a dispatch table (it has 'entries'), not a profile"),
    (["verify", "t.yaml", "s.py:f", "--prune", "-o", "p.yaml", "--no-ablate"], "it needs the ablation that --no-"),
    (["verify", "t.yaml", "s.py:f", "--json", "adir"], "--json adir is a directory"),
])
def test_bad_input_exits_2_with_a_message(tmp_path, monkeypatch, capsys, args, message):
    """Refused before any work: nothing is tuned, recorded or run (no ``ran`` file)."""
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"version": 1, "sites": [{**GOOD, "op": "layernorm"}]}))
    (tmp_path / "good.yaml").write_text(yaml.safe_dump({"version": 1, "sites": [GOOD]}))
    (tmp_path / "sampled.yaml").write_text(yaml.safe_dump({"version": 2, "sites": [{**GOOD, "samples": "garbage.pt"}]}))
    (tmp_path / "garbage.pt").write_text("not a tensor file")
    (tmp_path / "adir").mkdir()
    (tmp_path / "table.yaml").write_text(yaml.safe_dump({"version": 2, "fingerprint": {"backend": "cpu"},
                                                         "entries": []}))
    (tmp_path / "binary.yaml").write_bytes(b"version: 2\n\xff\xfe\x00entries: []\n")
    monkeypatch.chdir(tmp_path)
    code = cli_here(*args)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "t.yaml").exists()


def test_bad_switch_value_exits_2():
    r = cli("list", env={"NKI_AUTOTUNE_KERNELS": "sometimes"})
    assert r.returncode == 2 and "NKI_AUTOTUNE_KERNELS='sometimes'" in r.stderr and "Traceback" not in r.stderr


def test_run_refuses_while_recording(tmp_path, monkeypatch):
    (tmp_path / "good.yaml").write_text(yaml.safe_dump({"version": 1, "sites": [GOOD]}))
    (tmp_path / "binary.yaml").write_bytes(b"version: 2\n\xff\xfe\x00entries: []\n")
    monkeypatch.setenv("NKI_AUTOTUNE_RECORD", "x.yaml")
    r = here("run", "good.yaml", "-o", "t.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "NKI_AUTOTUNE_RECORD is set" in r.stderr
    assert not (tmp_path / "t.yaml").exists() and not (tmp_path / "x.yaml").exists()


def test_show_and_diff_import_neither_torch_nor_kernels_and_flag_stale_entries(tuned, tmp_path):
    _, _, out, _ = tuned
    doc = yaml.safe_load(out.read_text())
    doc["entries"][0].update(source="0123456789abcdef", module="nki_autotune.kernels.rmsnorm.cpu")
    doc["entries"][0]["measured"]["calibration"] = {"us": 900.0, "typical_us": 400.0, "disturbed": "busy"}
    stale = tmp_path / "stale.yaml"
    stale.write_text(yaml.safe_dump(doc, sort_keys=False))
    code = textwrap.dedent(f"""
        import sys
        from nki_autotune.autotune.cli import main
        rc = main(["show", {str(stale)!r}]) or main(["diff", {str(out)!r}, {str(stale)!r}])
        heavy = sorted(m for m in ("torch", "numba", "nki_autotune.kernels") if m in sys.modules)
        print("HEAVY", heavy)
        sys.exit(rc)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if not k.startswith("NKI_AUTOTUNE_")})
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout
    assert "STALE" in r.stdout and "DISTURBED" in r.stdout and "0123456789abcdef" in r.stdout


PLUGIN = '''
import torch
from nki_autotune.registry import Impl, Op, register_impl, register_op


def reference(x, alpha):
    return x * alpha


OP = register_op(Op(name="scale", reference=reference, tensors=("x",), attrs={"alpha": float},
                    defaults={"alpha": 2.0}, differentiable=("x",),
                    make_inputs=lambda key, gen, samples=None: (torch.randn(key.inputs[0].shape, generator=gen),),
                    examples=(((((3, 5), "float32"),), {}),)))
register_impl(Impl(op=OP, name="cpu_mul", backend="cpu",
                   forward=lambda t, a, c: (t[0] * a["alpha"],), fake=lambda t, a: (torch.empty_like(t[0]),),
                   supports=lambda specs, attrs: None))
'''


def test_import_registers_user_ops_for_list_check_and_run(tmp_path):
    (tmp_path / "myplugin.py").write_text(PLUGIN)
    env = {"PYTHONPATH": str(tmp_path)}
    r = cli("list", "--import", "myplugin", env=env)
    assert r.returncode == 0 and "cpu_mul" in r.stdout and "NKI_AUTOTUNE_KERNEL_SCALE" in r.stdout
    r = cli("check", "--import", "myplugin", "--ops", "scale", env=env)
    assert r.returncode == 0 and "scale.cpu_mul" in r.stdout and " 0 failed" in r.stdout
    r = here("list", "--import", "no_such_plugin_xyz")
    assert r.returncode == 2 and "--import no_such_plugin_xyz: cannot import it" in r.stderr


def test_record_merges_the_profiles_of_ranks(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, subprocess, sys
        if "RANK" not in os.environ:  # a stand-in for torchrun: the same script on two ranks
            for rank in ("0", "1"):
                subprocess.run([sys.executable, __file__], env={**os.environ, "RANK": rank, "WORLD_SIZE": "2"},
                               check=True)
            sys.exit(0)
        import torch
        import nki_autotune.kernels as nk
        rows = 4 if os.environ["RANK"] == "0" else 6
        for _ in range(3):
            nk.rmsnorm(torch.randn(rows, 16), torch.ones(16))
    """))
    out = tmp_path / "p.yaml"
    r = here("record", "-o", out, "--", sys.executable, script, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "merging the profiles of 2 ranks" in r.stdout
    shapes = sorted(s["inputs"][0]["shape"][0] for s in yaml.safe_load(out.read_text())["sites"])
    assert shapes == [4, 6]
    assert (tmp_path / "p.rank0.yaml").exists() and (tmp_path / "p.rank1.yaml").exists()
    merged = tmp_path / "m.yaml"
    r = here("record", "-o", merged, "--merge", tmp_path / "p.rank0.yaml", tmp_path / "p.rank1.yaml")
    assert r.returncode == 0 and "2 call sites" in r.stdout


def test_adding_a_kernel_works_as_docs_adding_an_op_says(tmp_path):
    readme = (Path(__file__).resolve().parents[1] / "docs" / "adding-an-op.md").read_text()
    section = readme.split("# Adding a kernel", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) < 60
    (tmp_path / "axpy.py").write_text(code)
    env = {"PYTHONPATH": str(tmp_path)}
    r = cli("check", "--import", "axpy", "--ops", "axpy", env=env)
    assert r.returncode == 0 and "axpy.cpu_blocks" in r.stdout and " 0 failed" in r.stdout, r.stdout + r.stderr
    use = textwrap.dedent("""
        import torch
        import nki_autotune.kernels  # noqa: F401  (the pack first, as a patched model imports it)
        from nki_autotune.registry import explain
        import axpy
        x, y = torch.randn(3, 100, requires_grad=True), torch.randn(3, 100, requires_grad=True)
        assert explain("axpy", x, y, 2.0).path == "kernel"
        out = axpy.axpy(x, y, 2.0)
        out.sum().backward()
        torch.testing.assert_close(out, x + 2.0 * y)
        torch.testing.assert_close(y.grad, torch.full_like(y, 2.0))
        print("OK")
    """)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NKI_AUTOTUNE_")}
    r = subprocess.run([sys.executable, "-c", use], capture_output=True, text=True, cwd=tmp_path,
                       env={**clean, **env, "NKI_AUTOTUNE_KERNEL_AXPY": "on"})  # set before the op exists
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_record_saves_samples_when_the_variable_asks_for_them(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import nki_autotune.kernels as nk
        nk.embedding(torch.tensor([[1, 2, 3]]), torch.randn(5, 4))
    """))
    monkeypatch.setenv("NKI_AUTOTUNE_RECORD_SAMPLES", "1")
    r = here("record", "-o", tmp_path / "p.yaml", "--", sys.executable, script, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert list((tmp_path / "p.samples").glob("*.pt")) and "samples:" in (tmp_path / "p.yaml").read_text()


def test_verify_names_what_is_wrong_with_a_stale_table_or_a_step_that_is_not_one(tuned, tmp_path):
    d, _, out, _ = tuned
    (tmp_path / "s.py").write_text("def make_step():\n    return 3\n")
    r = here("verify", out, "s.py:make_step", "--rounds", "6", "--warmup", "0", cwd=tmp_path)
    assert r.returncode == 2 and "STEP returned int, not the callable" in r.stderr, r.stderr
    stale = yaml.safe_load(out.read_text())
    for e in stale["entries"]:
        e["source"] = "0123456789abcdef"
    (tmp_path / "stale.yaml").write_text(yaml.safe_dump(stale))
    r = here("verify", "stale.yaml", "s.py:make_step", cwd=tmp_path)
    assert r.returncode == 2 and "(verify measures only a table that is current on this machine)" in r.stderr
    assert "tuned for source 0123456789abcdef" in r.stderr and "NKI_AUTOTUNE_STRICT" not in r.stderr


def test_an_interrupted_run_leaves_the_table_it_would_replace_whole(tmp_path, monkeypatch):
    """The table is written once every key is complete (storage keeps what was measured, for the next run):
    an interrupted run does not leave a partial table where a complete one was."""
    from nki_autotune.autotune import cli as cli_module
    from nki_autotune.autotune.tuner import Tuner
    from nki_autotune.registry import Entry

    calls = []

    def tune_key(self, key, sites, profile=None):
        calls.append(key)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return Entry(key, None, sites=[s.label() for s in sites], reason="decided")

    monkeypatch.setattr(Tuner, "tune_key", tune_key)
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"version": 2, "sites": [
        GOOD, {**GOOD, "site": "m.b", "inputs": [{"shape": [2, 8], "dtype": "float32"},
                                                  {"shape": [8], "dtype": "float32"}]}]}))
    out = tmp_path / "dispatch.yaml"
    out.write_text("the complete table of an earlier run\n")
    rc = cli_module.main(["run", str(prof), "-o", str(out), "-q", "--backend", "cpu", "--storage",
                          f"sqlite:///{tmp_path}/s.db"])
    assert rc == 130 and len(calls) == 2
    assert out.read_text() == "the complete table of an earlier run\n"


@pytest.mark.timeout(900)  # one run of two keys (big enough to be measurable), on a machine with one core taken
def test_a_cpu_hog_for_the_whole_run_flags_every_entry(tmp_path):
    """Another process spins on a core from before the run to after it: each entry (one: the hog slows the other
    tests' worker too) is DISTURBED in the table and in ``show``, and ``run`` says how many (the load is there from
    the first calibration reading to the last)."""
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"version": 1, "sites": [
        {**GOOD, "site": f"m.{rows}", "inputs": [{"shape": [rows, 512], "dtype": "float32"},
                                                 {"shape": [512], "dtype": "float32"}]} for rows in (64,)]}))
    out = tmp_path / "t.yaml"
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        r = cli("run", str(prof), "-o", str(out), "--trials", "1", "--rounds", "3", "--final-rounds", "6",
                "--retries", "0", "--pause", "0", "--storage", f"sqlite:///{tmp_path}/s.db")
    finally:
        hog.kill()
        hog.wait()
    assert r.returncode == 0, r.stderr
    entries = load_table(out).entries
    assert len(entries) == 1 and all((e.measured.get("calibration") or {}).get("disturbed") for e in entries), \
        [e.measured for e in entries]
    assert "1 of 1 entries were measured on a disturbed machine" in r.stdout
    shown = cli("show", str(out)).stdout
    assert shown.count("DISTURBED") >= 1 and shown.count("disturbed: ") >= 1, shown
