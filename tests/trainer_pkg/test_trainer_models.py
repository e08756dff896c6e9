import pytest
import torch

from trainer_pkg.config import ConfigError
from trainer_pkg.models import build_model


@pytest.mark.parametrize(
    "arch, params, shape",
    [
        ("mlp", {}, (64,)),
        ("mlp", {"num_layers": 3, "hidden_size": 16}, (1, 8, 8)),
        ("cnn", {}, (1, 8, 8)),
        ("cnn", {"num_blocks": 4, "channels": 4}, (3, 32, 32)),
        ("cnn", {"num_blocks": 6, "channels": 2}, (3, 5, 5)),  # pools stop shrinking at 1 pixel
        ("resnet", {}, (3, 32, 32)),
        ("resnet", {"width": 4, "num_stages": 2, "blocks_per_stage": 2}, (1, 8, 8)),
    ],
)
def test_output_is_batch_by_classes(arch, params, shape):
    torch.manual_seed(0)
    model = build_model(arch, params, shape, num_classes=7)
    out = model(torch.randn(5, *shape))
    assert out.shape == (5, 7)
    assert torch.isfinite(out).all()


def test_image_arch_rejects_tabular_input():
    with pytest.raises(ConfigError, match=r"cnn needs image inputs of shape \(C, H, W\).*\(64,\).*use mlp"):
        build_model("cnn", {}, (64,), 10)


def test_invalid_params_are_rejected_before_building():
    with pytest.raises(ConfigError, match="model.params.width"):
        build_model("resnet", {"width": 0}, (3, 8, 8), 10)


def test_same_seed_same_weights():
    torch.manual_seed(3)
    a = build_model("cnn", {}, (1, 8, 8), 10).state_dict()
    torch.manual_seed(3)
    b = build_model("cnn", {}, (1, 8, 8), 10).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
