"""A tiny training step for `nki-autotune verify` tests: two pack ops in a compiled model, AdamW."""

import torch
from torch import nn

import nki_autotune.kernels as nk


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(32))

    def forward(self, x):
        return nk.softmax(nk.rmsnorm(self.lin(x), self.norm), -1).pow(2).sum()


def make_step():
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = torch.compile(model, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(1)

    def step():
        x = torch.randn(64, 32, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = fwd(x)
        loss.backward()
        opt.step()
        return loss.detach()

    return step
