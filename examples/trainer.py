"""Train a tiny Hugging Face Llama patched with the kernel pack under ``transformers.Trainer`` (random weights and
random token data: nothing downloaded, nothing saved, nothing reported).

    python examples/trainer.py --steps 8
    nki-autotune record -o profile.yaml -- python examples/trainer.py
    nki-autotune run profile.yaml -o dispatch.yaml
    NKI_AUTOTUNE_TABLE=dispatch.yaml python examples/trainer.py

``TrainingArguments(torch_compile=True, gradient_accumulation_steps=2)``: the Trainer compiles the patched model
and accumulates two micro-batches a step, passing ``num_items_in_batch`` to the loss the patch bound (the sum over
both micro-batches' targets, not a mean of means). ``train(steps, patched)`` returns the loss of each step: the
patched model's follow the unpatched model's step by step (``tests/test_trainer.py``).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from nki_autotune.kernels.hf import patch

BATCH, SEQ = 4, 32
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=SEQ, pad_token_id=0, tie_word_embeddings=False,
              use_cache=False)


class Tokens(torch.utils.data.Dataset):
    """Token rows of a learnable sequence (next token = previous + 7) from a random start, of random length and
    right-padded: ``input_ids``, ``attention_mask`` and ``labels`` (-100 on the padding); the same rows for the
    same seed."""

    def __init__(self, rows: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        vocab = CONFIG["vocab_size"]
        start = torch.randint(1, vocab, (rows, 1), generator=g)
        self.ids = 1 + (start + 7 * torch.arange(SEQ)) % (vocab - 1)
        lengths = torch.randint(SEQ // 2, SEQ + 1, (rows, 1), generator=g)
        self.mask = (torch.arange(SEQ) < lengths).long()
        self.ids = self.ids.masked_fill(self.mask == 0, CONFIG["pad_token_id"])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i],
                "labels": self.ids[i].masked_fill(self.mask[i] == 0, -100)}


class LossTrainer(Trainer):
    """``Trainer`` keeping each micro-batch's loss exactly (its log rounds them to four digits)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.micro_losses: list[float] = []

    def training_step(self, *args, **kwargs) -> torch.Tensor:
        loss = super().training_step(*args, **kwargs)
        self.micro_losses.append(loss.item())
        return loss


def train(steps: int = 8, patched: bool = True, compile: bool = True, seed: int = 0) -> list[float]:
    """Train a tiny Llama (patched unless told not to) for ``steps`` optimizer steps; the loss of each step."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    if patched:
        patch(model)
    accumulate = 2
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=accumulate, torch_compile=True if compile else False, learning_rate=1e-2,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=steps, report_to=[],
            save_strategy="no", use_cpu=True, seed=seed, data_seed=seed, dataloader_num_workers=0,
            disable_tqdm=True)
        trainer = LossTrainer(model=model, args=args, train_dataset=Tokens(steps * accumulate * BATCH, seed))
        trainer.train()
    micro = trainer.micro_losses  # each scaled by the Trainer so that a step's micro-batches sum to its loss
    return [sum(micro[i:i + accumulate]) for i in range(0, len(micro), accumulate)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eager", action="store_true", help="TrainingArguments(torch_compile=False)")
    p.add_argument("--unpatched", action="store_true", help="train the model transformers builds, not patched")
    args = p.parse_args()
    losses = train(args.steps, patched=not args.unpatched, compile=not args.eager)
    print(" ".join(f"{x:.4f}" for x in losses))


if __name__ == "__main__":
    main()
