"""Peak training memory of the example's Hugging Face Llama: patched with the pack (kernels off, and every kernel
on) against the unpatched model, each compiled as it trains (inductor, fullgraph).

Memory is the peak of one full step (forward, backward, the example's AdamW) above what is live before it, as the
tuner and ``verify`` measure it (``nki_autotune.autotune.memory.peak_bytes``: PyTorch's allocations, numpy's, and
every block of the kernels' reused memory the step takes an output from), plus what is live before it (weights,
AdamW state; no gradients). Run: ``pytest benchmarks/test_memory.py -s`` (part of ``make bench``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nki_autotune.autotune.memory import peak_bytes  # noqa: E402
from nki_autotune.kernels import hf  # noqa: E402
from nki_autotune.registry import scope  # noqa: E402

TARGET = 1.05  # the patched model's peak may exceed the unpatched one's by 5% at most
_EXAMPLES = Path(__file__).parents[1] / "examples"
sys.path.insert(0, str(_EXAMPLES))  # the example's own imports (examples/steps.py) resolve as when it runs
_spec = importlib.util.spec_from_file_location("example_train", _EXAMPLES / "train.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)
from steps import optimizer  # noqa: E402


def live_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes a training step keeps between steps: weights, buffers, optimizer state (gradients are set to None)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for state in opt.state.values() for t in state.values() if torch.is_tensor(t)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def measure(patched: bool, env: dict[str, str]) -> tuple[int, int]:
    """(bytes live between steps, peak bytes above them during a step) of the example's compiled training step."""
    with scope(**env):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**example.CONFIG))
        if patched:
            hf.patch(model)
        opt = optimizer(model)
        forward = torch.compile(model, fullgraph=True, dynamic=False)
        data = example.batches(0)

        def step():
            forward(**next(data)).loss.backward()
            opt.step()

        for _ in range(2):  # compile, and create AdamW's state
            opt.zero_grad(set_to_none=True)
            step()
        peaks = []
        for _ in range(3):
            # Each measured step starts as live_bytes counts, with no gradients, so that live_bytes plus the step's
            # peak above it is the whole peak: the last step's gradients, freed during the step, are not counted as
            # freed (the measure counts only what the step allocates).
            opt.zero_grad(set_to_none=True)
            peaks.append(peak_bytes(step))
        return live_bytes(model, opt), min(peaks)


def test_peak_training_memory_patched_vs_unpatched(capsys):
    variants = {"unpatched": (False, {}), "patched, kernels off": (True, {"NKI_AUTOTUNE_KERNELS": "off"}),
                "patched, every kernel on": (True, {"NKI_AUTOTUNE_KERNELS": "on"})}
    variants.update({f"patched, only {op} on": (True, {"NKI_AUTOTUNE_KERNELS": "off",
                                                       f"NKI_AUTOTUNE_KERNEL_{op.upper()}": "on"})
                     for op in hf.OPS})
    got = {name: measure(*v) for name, v in variants.items()}
    base = sum(got["unpatched"])
    with capsys.disabled():
        print(f"\npeak training memory of the example (LlamaForCausalLM, batch {example.BATCH} x {example.SEQ}, "
              f"float32, compiled): live between steps + peak above it during a step")
        for name, (live, peak) in got.items():
            print(f"  {name:<32} {live / 2**20:6.1f} MiB + {peak / 2**20:6.1f} MiB = {(live + peak) / 2**20:6.1f} MiB "
                  f"({(live + peak) / base:.3f}x)")
    assert sum(got["patched, kernels off"]) <= TARGET * base  # patching itself keeps nothing more alive
    over = {name: sum(v) / base for name, v in got.items() if sum(v) > TARGET * base}
    if over:  # custom ops save every input and output for their backward (registry/customop.py)
        pytest.xfail("above the unpatched peak by more than 5%: "
                     + ", ".join(f"{name} {ratio:.3f}x" for name, ratio in over.items()))
