"""A stand-in for TorchNeuron (``torch_neuronx``) with the functions its docs and sources name: ``nki_op``,
``wrap_nki``, ``synchronize``, and ``torch_neuronx.utils.get_platform_target`` / ``get_logical_neuron_cores``.

It behaves as the real ones do where the backend depends on it (torch_neuronx/nki_hop.py): ``nki_op`` infers the
schema from the annotations and registers the function itself as the fake; ``wrap_nki(kernel)(...)`` runs the
kernel at the LNC it reports (NKI 0.8: no launch grid needed), ``wrap_nki(kernel)[grid](...)`` at LNC ``grid[0]``,
which must be that LNC (NCC_EVRF066), both here through the simulation, on CPU tensors; on fake tensors it returns
empty outputs of the shapes the kernel produces, as TorchNeuron's fake rule does. It records what it was given.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types

import torch
from torch._library.infer_schema import infer_schema
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from nki_autotune.registry.neuron.nki import nki


class StandIn:
    def __init__(self, target: str = "trn2", lnc: int = 2):
        self.target, self.lnc = target, lnc
        self.ops: dict[str, object] = {}
        """op name -> the torch-level function registered through nki_op."""
        self.wrapped: list = []
        """kernels given to wrap_nki."""
        self.launches: list[tuple[object, tuple[int, ...], bool]] = []
        """(kernel, grid, on fake tensors) of every call through a wrap_nki caller."""
        self.synced = 0

    def nki_op(self, name, fn=None, mutates_args={}):  # noqa: B006  (TorchNeuron's signature)
        def dec(f):
            self.ops[name] = f
            op = torch.library.custom_op(name, f, mutates_args=(), schema=infer_schema(f, mutates_args=()))
            op.register_fake(f)
            return op

        return dec if fn is None else dec(fn)

    def wrap_nki(self, kernel):
        self.wrapped.append(kernel)
        return _Caller(self, kernel, ())

    def synchronize(self) -> None:
        self.synced += 1

    def install(self, monkeypatch) -> StandIn:
        mod = types.ModuleType("torch_neuronx")
        utils = types.ModuleType("torch_neuronx.utils")
        mod.nki_op, mod.wrap_nki, mod.synchronize, mod.utils = self.nki_op, self.wrap_nki, self.synchronize, utils
        utils.get_platform_target = lambda: self.target
        # as TorchNeuron's: the variable where it is set, else the instance's default
        utils.get_logical_neuron_cores = lambda: os.environ.get("NEURON_LOGICAL_NC_CONFIG") or str(self.lnc)
        for m in (mod, utils):  # importable as the installed package is: importlib.util.find_spec reads __spec__
            m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
        monkeypatch.setitem(sys.modules, "torch_neuronx", mod)
        monkeypatch.setitem(sys.modules, "torch_neuronx.utils", utils)
        return self


class _Caller:
    def __init__(self, standin: StandIn, kernel, grid: tuple[int, ...]):
        self.standin, self.kernel, self.grid = standin, kernel, grid

    def __getitem__(self, grid) -> _Caller:
        return _Caller(self.standin, self.kernel, (grid,) if isinstance(grid, int) else tuple(map(int, grid)))

    def __call__(self, *args):
        fake = any(isinstance(a, FakeTensor) for a in args)
        self.standin.launches.append((self.kernel, self.grid, fake))
        launch = nki.simulate(self.kernel[self.grid[0]] if self.grid else self.kernel)
        if not fake:
            return launch(*args)
        with unset_fake_temporarily():  # the kernel's output shapes, from a run on zeros of the inputs' shapes
            outs = launch(*(torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args))
        many = isinstance(outs, tuple)
        outs = tuple(torch.empty(o.shape, dtype=o.dtype) for o in (outs if many else (outs,)))
        return outs if many else outs[0]


def make_available(monkeypatch) -> StandIn:
    """The neuron backend available, as on a Trainium host, TorchNeuron played by the stand-in: what
    ``NKI_TESTS_NEURON=standin`` does for a whole run of the suite (``tests/conftest.py``; tests/README.md). The
    device keeps its name: CPU tensors stay on the cpu backend's impls, as they do on a Trainium host."""
    from nki_autotune.registry.neuron import NeuronBackend

    s = StandIn("trn2", lnc=2).install(monkeypatch)
    monkeypatch.setattr(NeuronBackend, "why_unavailable", lambda self: None)
    monkeypatch.setattr(NeuronBackend, "available", lambda self: True)
    return s
