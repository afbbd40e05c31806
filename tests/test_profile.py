"""Profiles and the recorder: format, validation, site labels, call counts, samples, NKI_AUTOTUNE_RECORD."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from torch import nn

import nki_autotune.kernels as nk
from nki_autotune.registry import Profile, ProfileError, Site, TensorSpec, load_profile, ops, record

from .helpers import key_of


class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return nk.rmsnorm(x, self.weight, 1e-5)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Norm(16), Norm(16)])
        self.head_norm = Norm(8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head_norm(x[..., :8].contiguous()).sum()


def test_round_trip(tmp_path):
    p = Profile([Site("rmsnorm", (TensorSpec((2, 3, 8), "float32", requires_grad=True), TensorSpec((8,), "float32")),
                      {"eps": 1e-5, "offset": 0.0}, "m.norm", 4)])
    p.save(tmp_path / "p.yaml")
    back = load_profile(tmp_path / "p.yaml", ops())
    assert back.sites == p.sites
    text = (tmp_path / "p.yaml").read_text()
    assert "{shape: [2, 3, 8], dtype: float32, requires_grad: true}" in text


def _write(tmp_path, sites):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "sites": sites}))
    return str(path)


GOOD = {"op": "rmsnorm", "site": "m.n",
        "inputs": [{"shape": [4, 8], "dtype": "float32"}, {"shape": [8], "dtype": "float32"}],
        "attrs": {"eps": 1e-6}, "calls": 2}


@pytest.mark.parametrize("change, where, what", [
    ({"op": "layernorm"}, "sites[0] (m.n)", "field 'op': unknown op 'layernorm'"),
    ({"inputs": [{"shape": [4, 8], "dtype": "float32"}]}, "sites[0] (m.n)", "field 'inputs': rmsnorm takes 2"),
    ({"inputs": [{"shape": [4, -8], "dtype": "float32"}, {"shape": [8], "dtype": "float32"}]}, "inputs[0]", "shape"),
    ({"inputs": [{"shape": [4, 8], "dtype": "f32"}, {"shape": [8], "dtype": "float32"}]}, "inputs[0]", "unknown dtype"),
    ({"calls": 0}, "sites[0] (m.n)", "field 'calls': must be at least 1"),
    ({"calls": "many"}, "sites[0] (m.n)", "field 'calls': expected an integer"),
    ({"attrs": {"eps": "x"}}, "sites[0] (m.n)", "field 'attrs.eps'"),
    ({"samples": "nope.pt"}, "sites[0] (m.n)", "field 'samples': no such file"),
    ({"colour": 1}, "sites[0] (m.n)", "field 'colour': unknown field"),
])
def test_bad_profiles_name_file_site_and_field(tmp_path, change, where, what):
    path = _write(tmp_path, [{**GOOD, **change}])
    with pytest.raises(ProfileError) as e:
        load_profile(path, ops())
    msg = str(e.value)
    assert msg.startswith(path) and where in msg and what in msg, msg


def test_missing_attrs_take_the_op_defaults(tmp_path):
    site = {k: v for k, v in GOOD.items() if k != "attrs"}
    prof = load_profile(_write(tmp_path, [site]), ops())
    assert prof.sites[0].attrs == {"eps": 1e-6, "offset": 0.0}


def test_keys_merge_sites_with_the_same_shape(tmp_path):
    prof = load_profile(_write(tmp_path, [GOOD, {**GOOD, "site": "m.other"}]), ops())
    keys = prof.keys(ops())
    assert len(keys) == 1 and [s.site for s in next(iter(keys.values()))] == ["m.n", "m.other"]


def test_recorder_labels_sites_by_module_and_counts_calls_per_step(tmp_path):
    net = Net()
    with record(tmp_path / "prof.yaml") as rec:
        for _ in range(3):
            net(torch.randn(2, 5, 16, requires_grad=True)).backward()
        nk.rmsnorm(torch.randn(3, 4), torch.ones(4))  # outside any module: file:line
    prof = load_profile(tmp_path / "prof.yaml", ops())
    assert rec.root_calls and max(rec.root_calls.values()) == 3
    by_label = {s.site: s for s in prof.sites}
    assert set(by_label) >= {"blocks.0", "blocks.1", "head_norm"}
    assert by_label["blocks.0"].calls == 1 and by_label["blocks.0"].inputs[0].shape == (2, 5, 16)
    assert by_label["blocks.0"].inputs[0].requires_grad and by_label["blocks.0"].attrs == {"eps": 1e-5, "offset": 0.0}
    assert by_label["head_norm"].inputs[0].shape == (2, 5, 8)
    loose = [s for s in prof.sites if "test_profile.py:" in s.site]
    assert len(loose) == 1
    keys = prof.keys(ops())
    assert key_of("rmsnorm", "training", [((2, 5, 16), "float32"), ((16,), "float32")], {"eps": 1e-5}) in keys


def test_calls_outside_any_module_count_per_step_by_the_least_called_site(tmp_path):
    x, w = torch.randn(3, 4), torch.ones(4)
    with record(tmp_path / "prof.yaml"):
        for step in range(4):
            nk.rmsnorm(x, w)
            nk.rmsnorm(x, w)
            nk.softmax(x if step % 2 else x[:2])  # one site, two keys: still once per step
    calls = sorted(s.calls for s in load_profile(tmp_path / "prof.yaml", ops()).sites)
    assert calls == [1, 1, 1, 1]  # two rmsnorm sites once per step of 4; softmax's keys, 2 calls each, round to 1


def test_recording_sees_calls_inside_compiled_regions(tmp_path):
    net = Net()
    compiled = torch.compile(net, fullgraph=True, dynamic=False)
    with record(tmp_path / "prof.yaml"):
        for _ in range(2):
            compiled(torch.randn(2, 5, 16))
    prof = load_profile(tmp_path / "prof.yaml", ops())
    assert {s.site for s in prof.sites} == {"blocks.0", "blocks.1", "head_norm"}
    assert all(s.calls == 1 for s in prof.sites)
    torch._dynamo.reset()


def test_samples_of_data_dependent_ops_are_saved_beside_the_profile(tmp_path, monkeypatch):
    op = ops()["rmsnorm"]
    monkeypatch.setattr(op, "data_dependent", ("x",))
    x = torch.randn(3, 4)
    with record(tmp_path / "prof.yaml", samples=True):
        nk.rmsnorm(x, torch.ones(4))
    prof = load_profile(tmp_path / "prof.yaml", ops())
    (site,) = prof.sites
    assert site.samples == "prof.samples/0000.pt"
    saved = torch.load(prof.samples_path(site))
    torch.testing.assert_close(saved["x"], x)


def test_record_variable_writes_the_profile_at_exit(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import torch
        import nki_autotune.kernels as nk
        for _ in range(4):
            nk.rmsnorm(torch.randn(6, 32), torch.ones(32))
    """))
    out = tmp_path / "p.yaml"
    env = {"NKI_AUTOTUNE_RECORD": str(out), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, str(script)], env=env, check=True, cwd=tmp_path)
    prof = load_profile(out, ops())
    (site,) = prof.sites
    assert site.calls == 1 and site.inputs[0].shape == (6, 32) and site.site.startswith("run.py:")  # 4 steps


def test_version_1_profiles_still_load_and_version_2_records_layouts(tmp_path):
    path = _write(tmp_path, [GOOD])  # version 1, as recorded before layouts were
    prof = load_profile(path, ops())
    assert prof.sites[0].inputs[0].strides is None
    x = torch.randn(16, 8).t()  # a transposed view
    with record(tmp_path / "v2.yaml"):
        nk.rmsnorm(x, torch.ones(16))
    text = (tmp_path / "v2.yaml").read_text()
    assert text.startswith("version: 2") and "strides: [1, 8]" in text
    (site,) = load_profile(tmp_path / "v2.yaml", ops()).sites
    assert site.inputs[0].strides == (1, 8)


def test_a_process_that_made_no_call_leaves_the_recorded_profile_as_it_was(tmp_path):
    """With NKI_AUTOTUNE_RECORD set, every process importing the pack records: a CLI command, a spawned worker or
    the parent of spawned ranks that made no call must not replace the profile with an empty one."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import torch
        import nki_autotune.kernels as nk
        nk.rmsnorm(torch.randn(6, 32), torch.ones(32))
    """))
    idle = tmp_path / "idle.py"
    idle.write_text("import nki_autotune.kernels\n")
    out = tmp_path / "p.yaml"
    env = {"NKI_AUTOTUNE_RECORD": str(out), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, str(script)], env=env, check=True, cwd=tmp_path)
    before = out.read_text()
    r = subprocess.run([sys.executable, str(idle)], env=env, check=True, cwd=tmp_path, capture_output=True,
                       text=True)
    assert out.read_text() == before and "made no call of a pack op" in r.stderr
    (site,) = load_profile(out, ops()).sites
    assert site.calls == 1


@pytest.mark.parametrize("record, message", [
    ("adir", "NKI_AUTOTUNE_RECORD='adir': adir is a directory"),
    ("afile/p.yaml", "NKI_AUTOTUNE_RECORD='afile/p.yaml': afile/p.yaml cannot be written: "),
])
def test_a_record_path_that_cannot_be_a_file_is_refused_when_the_pack_is_imported(tmp_path, record, message):
    """Found at exit, after the whole run, the profile would be lost; at import the run has not started."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    env = {"NKI_AUTOTUNE_RECORD": record, "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", "import nki_autotune.kernels; open('ran', 'w')"], env=env,
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert not (tmp_path / "ran").exists()
