"""Models by name, the missing-library error, and the no-decay parameter group."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trainers.models import BUILTIN_MODELS, ModelError, build_model, parameter_groups


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtin_models_classify(name):
    model = build_model(name, 7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_nobn_model_has_no_batch_statistics():
    model = build_model("cnn-nobn", 3)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in build_model("cnn", 3).modules())


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="torchvision installed"
)
def test_torchvision_model_without_torchvision_says_how_to_install():
    with pytest.raises(ModelError, match="pip install torchvision"):
        build_model("torchvision:resnet50", 10)


def test_unknown_model_lists_the_builtins():
    with pytest.raises(ModelError, match="built-in models are cnn"):
        build_model("no-such-net", 10)
    with pytest.raises(ModelError, match="unknown model library"):
        build_model("keras:resnet", 10)


def test_no_weight_decay_on_norms_and_biases():
    model = build_model("resnet-tiny", 4)
    decay, no_decay = parameter_groups(model, 0.05)
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"])
    norm_weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert all(any(w is p for p in no_decay["params"]) for w in norm_weights)
    total = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == total
