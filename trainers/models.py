"""Models by name: small built-in CNN/ResNet for tests and CPU demos; torchvision/timm too.

`cnn-nobn` has no BatchNorm, so accumulating K micro-batches of B gives the
same gradient as one batch of K x B (BatchNorm statistics would differ): the
accumulation-equivalence test uses it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from shards.errors import UsageError


class ModelError(UsageError):
    """Unknown model name, or its library is not installed."""


def conv_block(inputs: int, outputs: int, stride: int, norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(inputs, outputs, 3, stride, 1, bias=not norm)]
    if norm:
        layers.append(nn.BatchNorm2d(outputs))
    layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Four 3x3 conv blocks (three strided, the first one too: cheap on CPU), pool, linear head."""

    def __init__(self, num_classes: int, width: int = 16, norm: bool = True) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_block(3, width, 2, norm),
            conv_block(width, width * 2, 2, norm),
            conv_block(width * 2, width * 4, 2, norm),
            conv_block(width * 4, width * 4, 1, norm),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.features(x)), 1))


class BasicBlock(nn.Module):
    """ResNet basic block with BatchNorm; a 1x1 projection when the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """A small ResNet: strided 3x3 stem, three stages of basic blocks, pool, linear head."""

    def __init__(self, num_classes: int, blocks: tuple[int, ...] = (1, 1, 1), width: int = 16):
        super().__init__()
        self.stem = conv_block(3, width, 2, norm=True)
        stages: list[nn.Module] = []
        inputs = width
        for index, count in enumerate(blocks):
            outputs = width * 2**index
            for block in range(count):
                stride = 2 if block == 0 and index > 0 else 1
                stages.append(BasicBlock(inputs, outputs, stride))
                inputs = outputs
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(inputs, num_classes)
        for module in self.modules():
            if isinstance(module, BasicBlock):
                # Zero-init the last BN of each residual branch: blocks start as identities.
                nn.init.zeros_(module.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


BUILTIN_MODELS: dict[str, Callable[[int], nn.Module]] = {
    "cnn": partial(SmallCNN, norm=True),
    "cnn-nobn": partial(SmallCNN, norm=False),
    "resnet-tiny": partial(SmallResNet, blocks=(1, 1, 1)),
    "resnet-small": partial(SmallResNet, blocks=(2, 2, 2)),
}
LIBRARIES = {"torchvision": "torchvision", "timm": "timm"}
LIST_HINT = {"torchvision": "torchvision.models.list_models()", "timm": "timm.list_models()"}


def build_model(name: str, num_classes: int) -> nn.Module:
    """A freshly initialised model with `num_classes` outputs.

    Args:
        name: a built-in name (`cnn`, `cnn-nobn`, `resnet-tiny`, `resnet-small`),
            `torchvision:NAME` or `timm:NAME`; a bare unknown name is looked up
            in torchvision, then timm.
        num_classes: size of the classifier head.

    Raises:
        ModelError: unknown name, or the library that provides it is not installed.
    """
    if num_classes < 1:
        raise ModelError(f"num_classes must be at least 1, got {num_classes}")
    library, model_name = resolve_model_name(name)
    if library is None:
        return BUILTIN_MODELS[model_name](num_classes)
    return library_model(library, model_name, num_classes)


def resolve_model_name(name: str) -> tuple[str | None, str]:
    """`(library, name)` that provides `--model name` (library None: built-in), building nothing.

    Cheap enough to run before any data is read, so a typo stops the run at once.

    Raises:
        ModelError: unknown name, or the library that provides it is not installed.
    """
    if name in BUILTIN_MODELS:
        return None, name
    library, _, model_name = name.rpartition(":")
    if library:
        if library not in LIBRARIES:
            raise ModelError(
                f"unknown model library {library!r} in --model {name!r}; use torchvision:NAME "
                f"or timm:NAME, or a built-in model: {', '.join(BUILTIN_MODELS)}"
            )
        if not has_model(library, model_name):
            raise ModelError(
                f"{library} has no model {model_name!r}; "
                f"{LIST_HINT[library]} lists the names it has"
            )
        return library, model_name
    for library in LIBRARIES:
        if importlib.util.find_spec(library) is not None and has_model(library, name):
            return library, name
    raise ModelError(
        f"unknown model {name!r}: built-in models are {', '.join(BUILTIN_MODELS)}; "
        "torchvision and timm models need those packages: pip install 'shardpipe[vision]' "
        "(a torchvision build matching your torch), then --model torchvision:NAME or timm:NAME"
    )


def import_library(library: str):
    try:
        return importlib.import_module(library)
    except ImportError as exc:
        raise ModelError(
            f"{library} models need the {library} package, which is not installed (or does not "
            f"import: {exc}). Install it with `pip install {library}` (for torchvision, the "
            f"build matching torch {torch.__version__}), or pick a built-in model: "
            f"{', '.join(BUILTIN_MODELS)}"
        ) from exc


def has_model(library: str, name: str) -> bool:
    module = import_library(library)
    if library == "timm":
        return name in module.list_models()
    return name in module.models.list_models()


def library_model(library: str, name: str, num_classes: int) -> nn.Module:
    """`torchvision.models.get_model` or `timm.create_model`, randomly initialised.

    `name` must be one `resolve_model_name` accepted.
    """
    module = import_library(library)
    if library == "timm":
        return module.create_model(name, pretrained=False, num_classes=num_classes)
    return module.models.get_model(name, weights=None, num_classes=num_classes)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two optimizer groups: weights with decay, and norm weights + biases without.

    Decaying BatchNorm scales and biases only pulls them towards zero without
    regularising anything (the usual recipe since Goyal et al. 2017), so every
    parameter with fewer than two dimensions goes to the no-decay group.
    """
    decay, no_decay = [], []
    for parameter in model.parameters():
        if not parameter.requires_grad:
            continue
        (no_decay if parameter.ndim <= 1 else decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
