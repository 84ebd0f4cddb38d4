"""Benchmark models: an MLP, a 6-layer tanh MLP, a ResNet-style CNN (ReLU(inplace=True) + BatchNorm), a GPT-style
transformer (6 blocks, d=256, seq 128) and a Hugging Face GPT-2 built from a config."""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, din=256, hidden=512, depth=4, dout=10):
        super().__init__()
        layers, d = [], din
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.ReLU()]
            d = hidden
        self.net = nn.Sequential(*layers, nn.Linear(d, dout))

    def forward(self, x):
        return self.net(x)


class TanhMLP(nn.Module):
    """A plain deep MLP with tanh between its layers (as in makemore, part 3): ``layers`` Linear layers, the
    hidden ones ``width`` wide."""

    def __init__(self, din=256, width=256, layers=6, dout=10):
        super().__init__()
        mods, d = [], din
        for _ in range(layers - 1):
            mods += [nn.Linear(d, width), nn.Tanh()]
            d = width
        self.net = nn.Sequential(*mods, nn.Linear(d, dout))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x):
        idt = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += idt
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, width=32, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        self.layers = nn.Sequential(Block(width, width), Block(width, width), Block(width, 2 * width, 2),
                                    Block(2 * width, 2 * width), Block(2 * width, 4 * width, 2),
                                    Block(4 * width, 4 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class Attention(nn.Module):
    def __init__(self, d, heads, block):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.register_buffer("mask", torch.tril(torch.ones(block, block)).view(1, 1, block, block),
                             persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = F.softmax(att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))


class GPTBlock(nn.Module):
    def __init__(self, d, heads, block):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, block)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=512, d=256, layers=6, heads=8, block=128):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList([GPTBlock(d, heads, block) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def hf_gpt2(n_layer=4, n_embd=256, n_head=8, vocab=1024, n_positions=128):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                                      n_positions=n_positions))


def seq_loss(out, y):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# name -> (factory, batch factory, loss)
def registry(device: str = "cpu") -> dict[str, tuple[Callable, Callable, Callable]]:
    def batch(shape_fn):
        g = torch.Generator().manual_seed(0)
        return lambda: tuple(t.to(device) for t in shape_fn(g))
    return {
        "mlp": (MLP, batch(lambda g: (torch.randn(256, 256, generator=g), torch.randint(0, 10, (256,), generator=g))),
                F.cross_entropy),
        # the 6-layer tanh MLP of the dense tier's benchmark (width 256, batch 128; trained with SGD there)
        "tanh-mlp": (TanhMLP, batch(lambda g: (torch.randn(128, 256, generator=g),
                                                torch.randint(0, 10, (128,), generator=g))), F.cross_entropy),
        "cnn": (ResNet, batch(lambda g: (torch.randn(16, 3, 32, 32, generator=g),
                                         torch.randint(0, 10, (16,), generator=g))), F.cross_entropy),
        "gpt": (GPT, batch(lambda g: (torch.randint(0, 512, (4, 128), generator=g),
                                      torch.randint(0, 512, (4, 128), generator=g))), seq_loss),
        "hf-gpt2": (hf_gpt2, batch(lambda g: (torch.randint(0, 1024, (4, 128), generator=g),
                                              torch.randint(0, 1024, (4, 128), generator=g))), seq_loss),
        # GPT-2 small (124M parameters, random init) for the accelerator run
        "hf-gpt2-small": (lambda: hf_gpt2(n_layer=12, n_embd=768, n_head=12, vocab=50257, n_positions=1024),
                          batch(lambda g: (torch.randint(0, 50257, (8, 512), generator=g),
                                           torch.randint(0, 50257, (8, 512), generator=g))), seq_loss),
    }
