"""The Hugging Face model families the patching knows, and the exact classes it patches in each."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from torch import nn


@dataclass(frozen=True)
class Family:
    """One family: its ``config.model_type``, the class-name prefix of its modeling module, and how its modeling
    code computes what the op folders' hooks replace (each hook reads the fields it needs)."""

    model_type: str
    prefix: str
    module: str = ""
    """The modeling module's folder, where it is not the model type (Gemma 3's text model lives in ``gemma3``)."""
    names: tuple[tuple[str, str], ...] = ()
    """Class names of kinds that do not follow ``prefix + kind`` (Gemma 3's text ``Model``)."""
    gemma: bool = False
    """Gemma's numerics: RMSNorm scales by ``1 + weight`` and casts the product (not the norm) to the input's dtype;
    the MLP is GELU(tanh)-gated; the token embedding is scaled by sqrt(hidden size) (``TextScaledWordEmbedding``)."""
    norm: str = "rmsnorm_forward"
    """The RMSNorm forward (``kernels/rmsnorm/hooks.py``): Llama's cast order (normalised in float32, cast, times
    the weight); OLMo 2's ``rmsnorm_float32_forward``; Gemma's ``gemma_rmsnorm_forward``."""
    fused_head: bool = True
    """Whether the causal LM's head and loss can be one ``nk.linear_cross_entropy`` call: its forward computes
    ``lm_head(hidden)`` (softcapped where the config says) and its loss on that; Granite divides the logits by
    ``logits_scaling`` first."""
    mlp: str = "mlp_forward"
    """The MLP forward (``kernels/swiglu/hooks.py``, ``kernels/geglu/hooks.py``): ``gate_proj`` and ``up_proj`` on
    swiglu; Phi-3's one ``gate_up_proj`` split in half: ``fused_mlp_forward``; Gemma's GELU(tanh)-gated
    ``geglu_mlp_forward``."""

    @property
    def modeling(self) -> ModuleType:
        folder = self.module or self.model_type
        return importlib.import_module(f"transformers.models.{folder}.modeling_{folder}")

    def cls(self, kind: str) -> type | None:
        """The family's class of one kind: RMSNorm, MLP, Attention, Model, ForCausalLM, TextScaledWordEmbedding
        (None where this transformers has no such class)."""
        return getattr(self.modeling, dict(self.names).get(kind, f"{self.prefix}{kind}"), None)


_GEMMA = {"gemma": True, "norm": "gemma_rmsnorm_forward", "mlp": "geglu_mlp_forward"}
FAMILIES = {f.model_type: f for f in (
    Family("llama", "Llama"), Family("mistral", "Mistral"), Family("qwen2", "Qwen2"), Family("qwen3", "Qwen3"),
    Family("gemma", "Gemma", **_GEMMA), Family("gemma2", "Gemma2", **_GEMMA),
    Family("gemma3_text", "Gemma3", module="gemma3", names=(("Model", "Gemma3TextModel"),), **_GEMMA),
    Family("phi3", "Phi3", mlp="fused_mlp_forward"),
    Family("olmo2", "Olmo2", norm="rmsnorm_float32_forward"),  # post-norms, q/k norms across all heads
    Family("granite", "Granite", fused_head=False),  # its multipliers live in the forwards left as they are
    Family("smollm3", "SmolLM3"),  # NoPE layers: their attention calls no rotary embedding and is not patched
    # mixtures of experts: the experts (kernels/moe_experts/hooks.py); the router stays the family's
    Family("qwen3_moe", "Qwen3Moe"), Family("mixtral", "Mixtral"),
    Family("olmoe", "Olmoe", norm="rmsnorm_forward"),  # q/k norms across all heads, Llama's cast order
)}


class UnsupportedModel(ValueError):
    """The model is not one of the families the patching knows."""


def families_of(model: nn.Module) -> list[Family]:
    """The families of the Hugging Face models in ``model``; an error for a model of any other family
    (another family's modules compute other things under the same names: OLMo 2 normalises after attention,
    Phi-3 fuses its projections)."""
    from transformers import PreTrainedModel

    supported = ", ".join(FAMILIES)
    found: dict[str, Family] = {}
    for name, m in model.named_modules():
        if not isinstance(m, PreTrainedModel):
            continue
        model_type = getattr(m.config, "model_type", None)
        if model_type not in FAMILIES:
            where = f" (at {name})" if name else ""
            raise UnsupportedModel(
                f"nki_autotune.kernels.hf: {type(m).__name__}{where} is of the family {model_type!r}, which is not "
                f"supported; supported families: {supported}")
        found[model_type] = FAMILIES[model_type]
    if not found:
        raise UnsupportedModel(
            f"nki_autotune.kernels.hf: {type(model).__name__} holds no Hugging Face model (a transformers "
            f"PreTrainedModel); supported families: {supported}")
    return list(found.values())
