"""How a training process computes, set up alike by `train` and its probes (`trainers.probe`).

Kernels (deterministic or autotuned cuDNN), the autocast dtype, and the optimizer over
`trainers.models.parameter_groups`: one place, so a probe measures the steps a run will take.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from trainers.config import Optimization
from trainers.models import ModelError, parameter_groups


def configure_determinism(deterministic: bool) -> None:
    """`--deterministic`: fixed cuDNN algorithms and deterministic kernels; else autotuned cuDNN."""
    if deterministic:
        # cuBLAS needs this before its first use to be deterministic.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = not deterministic


def resolve_amp(amp: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype; fp16 (with a GradScaler) is refused on CPU, where bf16 is the option."""
    if amp == "off":
        return None
    if amp == "fp16":
        if device.type != "cuda":
            raise ModelError(
                "--amp fp16 needs CUDA (it trains with a GradScaler); on CPU use --amp bf16 or off"
            )
        return torch.float16
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ModelError("--amp bf16: this GPU has no bfloat16 support; use --amp fp16")
    return torch.bfloat16


def build_optimizer(module: nn.Module, settings: Optimization, lr: float) -> torch.optim.Optimizer:
    """SGD or AdamW over two groups (no weight decay on norm weights and biases).

    `lr` is a placeholder: `WarmupCosine` sets the learning rate before every step.
    """
    groups = parameter_groups(module, settings.weight_decay)
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(settings.momentum, 0.999))
    return torch.optim.SGD(groups, lr=lr, momentum=settings.momentum, nesterov=settings.nesterov)
