"""A model and a task made from a seed, with nothing downloaded.

The task is teacher-student regression: inputs are Gaussian, targets come from a
fixed random "teacher" network, and the student (an MLP whose size is selectable)
learns to imitate it, so the loss visibly falls within a few dozen steps.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSize:
    """Student shape: ``depth`` hidden layers of ``hidden`` units."""

    inputs: int
    hidden: int
    depth: int
    outputs: int

    def parameter_count(self) -> int:
        dims = [self.inputs] + [self.hidden] * self.depth + [self.outputs]
        return sum(a * b + b for a, b in zip(dims, dims[1:], strict=False))


MODEL_SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(inputs=16, hidden=32, depth=2, outputs=4),       # ~1.7 k parameters
    "small": ModelSize(inputs=32, hidden=256, depth=3, outputs=8),     # ~0.14 M, ~0.6 MB
    "100mb": ModelSize(inputs=64, hidden=2048, depth=7, outputs=16),   # ~25.3 M, ~101 MB
}


class MLP(nn.Module):
    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        dims = [size.inputs] + [size.hidden] * size.depth
        layers: list[nn.Module] = []
        for a, b in zip(dims, dims[1:], strict=False):
            layers += [nn.Linear(a, b), nn.GELU()]
        layers.append(nn.Linear(dims[-1], size.outputs))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def build_model(size: ModelSize, seed: int) -> MLP:
    """The student, initialised from ``seed`` alone (same weights on every rank and every start)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MLP(size)


@dataclass(frozen=True)
class SyntheticTask:
    """``dataset_size`` samples; sample ``i`` is ``(inputs[i], targets[i])``."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def make(cls, size: ModelSize, seed: int, dataset_size: int) -> SyntheticTask:
        generator = torch.Generator().manual_seed(seed * 7919 + 17)
        inputs = torch.randn(dataset_size, size.inputs, generator=generator)
        teacher_in = torch.randn(size.inputs, 64, generator=generator) / size.inputs ** 0.5
        teacher_out = torch.randn(64, size.outputs, generator=generator) / 8.0
        with torch.no_grad():
            targets = torch.tanh(inputs @ teacher_in) @ teacher_out
        return cls(inputs=inputs, targets=targets)

    def __len__(self) -> int:
        return len(self.inputs)


def params_sha256(model: nn.Module) -> str:
    """sha256 of every parameter's bytes, in ``named_parameters`` order (names sorted)."""
    digest = hashlib.sha256()
    for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        digest.update(param.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
