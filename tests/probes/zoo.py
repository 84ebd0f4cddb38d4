"""A model zoo: the seeds' bug classes and healthy real-world architectures."""
from __future__ import annotations

import torch
import torch.nn as nn


# ----------------------------------------------------------------------------- healthy models
def BasicBlock(cin: int, cout: int, stride: int = 1) -> nn.Module:
    """The benchmark's residual block: ReLU(inplace=True), BatchNorm, in-place residual add."""
    from bench.models import Block
    return Block(cin, cout, stride)


class ResNetSmall(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def GPT(vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 4, block: int = 16) -> nn.Module:
    """GPT-style (the benchmark's model, small): tied embedding/head weights, a non-persistent
    causal mask buffer, dropout."""
    from bench.models import GPT as BenchGPT
    return BenchGPT(vocab=vocab, d=d, layers=layers, heads=heads, block=block)


class LSTMTagger(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, hidden: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, num_layers=2, batch_first=True, dropout=0.1)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))      # LSTM returns (output, (h, c))
        return self.out(h)


class MLP(nn.Module):
    def __init__(self, din: int = 32, hidden: int = 64, dout: int = 10, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = din
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.ReLU()]
            d = hidden
        layers.append(nn.Linear(d, dout))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


# ----------------------------------------------------------------------------- the seeds' bugs
class PlainListEncoder(nn.Module):
    def __init__(self, width=16, depth=3):
        super().__init__()
        self.blocks = [nn.Linear(width, width) for _ in range(depth)]

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


class XORClassifier(nn.Module):
    """Chapter 11's opening model: three Linear layers held in a plain list."""

    def __init__(self, width=16, depth=3):
        super().__init__()
        self.stem = nn.Linear(2, width)
        self.encoder = PlainListEncoder(width, depth)
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.encoder(torch.relu(self.stem(x))))


class Adapter(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.down = nn.Linear(dim, dim // 4)
        self.up = nn.Linear(dim // 4, dim)


class AdapterModel(nn.Module):
    """The chapter's closing exercise: adapters in a list, a gate tensor, a buffer, a frozen norm."""

    def __init__(self, dim=32, depth=2):
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.adapters = [Adapter(dim) for _ in range(depth)]
        self.gate = torch.ones(dim, requires_grad=True)
        self.register_buffer("positions", torch.arange(dim).float(), persistent=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        x = self.embed(x) + self.positions
        for a in self.adapters:
            x = x + a.up(torch.relu(a.down(x)))
        return self.head(self.norm(x) * self.gate)


class DeadReLU(nn.Module):
    """A ReLU layer whose pre-activations are pushed far below zero: every unit is dead."""

    def __init__(self, dead_units: int = 16, units: int = 16):
        super().__init__()
        self.fc = nn.Linear(8, units)
        with torch.no_grad():
            self.fc.bias[:dead_units] = -100.0
        self.act = nn.ReLU()
        self.out = nn.Linear(units, 2)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class Saturated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        with torch.no_grad():
            self.fc.weight.mul_(200.0)
        self.act = nn.Tanh()
        self.out = nn.Linear(16, 2)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class DropoutInList(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.regs = [nn.Dropout(0.5)]          # eval() never reaches it

    def forward(self, x):
        return self.regs[0](self.fc(x))


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.bn(self.fc(x)))


class ProducesNaN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bad = LogLayer()
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.bad(self.fc(x)))


class LogLayer(nn.Module):
    def forward(self, x):
        return torch.log(x)          # negative inputs -> NaN


class Bypass(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.proj.forward(x))     # skips proj's hooks


def make_closure_model():
    hidden = nn.Linear(8, 8)                      # held only by the closure below

    class ClosureModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            return self.out(hidden(self.fc(x)))
    return ClosureModel()


class CriterionInForward(nn.Module):
    """Builds a parameter-free loss module per call, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x, y=None):
        logits = self.fc(x)
        if y is None:
            return logits
        return nn.CrossEntropyLoss()(logits, y)


class FreshLinearEachCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return nn.Linear(8, 2)(self.fc(x))       # new random weights each call


class DictOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)
        self.none = NoneModule()
        self.ints = IntModule()

    def forward(self, x):
        self.none(x)
        self.ints(x)
        return {"a": self.a(x), "pair": (self.b(x), torch.arange(3)), "nothing": None}


class NoneModule(nn.Module):
    def forward(self, x):
        return None


class IntModule(nn.Module):
    def forward(self, x):
        return (x > 0).long()


def xor_data(n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 2, generator=g)
    y = ((X[:, 0] > 0) ^ (X[:, 1] > 0)).long()
    return X, y


class RoutedExpert(nn.Module):
    def __init__(self, d: int = 8, h: int = 32, dead_units: int = 0):
        super().__init__()
        self.fc = nn.Linear(d, h)
        with torch.no_grad():
            self.fc.bias[:dead_units] = -100.0
        self.act = nn.ReLU()
        self.out = nn.Linear(h, d)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class SometimesRoutedExperts(nn.Module):
    """Two experts; expert 0 (``dead_units`` of its ReLU units dead) gets a varying share of the tokens every other
    call and none in between, when it does not run: a mixture-of-experts expert the router skips on some steps."""

    def __init__(self, dead_units: int = 32):
        super().__init__()
        self.experts = nn.ModuleList([RoutedExpert(dead_units=dead_units), RoutedExpert()])
        self.head = nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x):
        n = 0 if self.calls % 2 else 40 + 7 * (self.calls % 5)      # tokens routed to expert 0
        self.calls += 1
        parts = [self.experts[0](x[:n])] if n else []
        h = torch.cat([*parts, self.experts[1](x[n:])]) + x
        return self.head(h)
