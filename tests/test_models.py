"""`resnet18_cifar`: torchvision's ResNet with a stem for small images, and ResNet-10 (built directly, no
training)."""

from __future__ import annotations

import pytest
import torch

from dalifeed.train.models import ModelError, build_model, check_input_size


def test_cifar_stem_keeps_the_image_size_into_the_first_stage():
    torch.manual_seed(0)
    model = build_model("resnet18_cifar", num_classes=10, width=32, image_size=16).eval()
    assert (model.conv1.kernel_size, model.conv1.stride, model.conv1.out_channels) == ((3, 3), (1, 1), 32)
    assert isinstance(model.maxpool, torch.nn.Identity)
    seen = {}
    model.layer1.register_forward_hook(lambda m, i, out: seen.update(layer1=out.shape))
    with torch.no_grad():
        logits = model(torch.randn(2, 3, 16, 16))
    assert logits.shape == (2, 10)
    assert seen["layer1"] == (2, 32, 16, 16)  # torchvision's stem: 4x4 here
    plain = build_model("resnet18", num_classes=10, width=32, image_size=16)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in plain.parameters())  # 3x3, not 7x7


def test_cifar_stem_without_width_and_on_a_deeper_resnet():
    model = build_model("resnet50_cifar", num_classes=3, image_size=32)
    assert model.conv1.out_channels == 64 and model.conv1.kernel_size == (3, 3)
    assert model.fc.out_features == 3


def test_cifar_stem_takes_tiny_images_that_the_imagenet_stem_refuses():
    # a batch of one needs more than 1x1 in the last stage (BatchNorm): 16 px keeps 2x2 there, 8 px does not
    with pytest.raises(ModelError, match="--image-size >= 33"):
        check_input_size("resnet18", 16, width=32, batch_size=1)
    check_input_size("resnet18_cifar", 16, width=32, batch_size=1)
    with pytest.raises(ModelError, match="--image-size >= 9"):
        check_input_size("resnet18_cifar", 8, width=32, batch_size=1)


def test_resnet10_is_resnet18_with_one_block_a_stage():
    r10 = build_model("resnet10_cifar", num_classes=10, width=16, image_size=16)
    r18 = build_model("resnet18_cifar", num_classes=10, width=16, image_size=16)
    assert [len(s) for s in (r10.layer1, r10.layer2, r10.layer3, r10.layer4)] == [1, 1, 1, 1]
    assert [type(m) for m in r10.layer4[0].modules()] == [type(m) for m in r18.layer4[0].modules()]
    assert isinstance(r10.maxpool, torch.nn.Identity) and r10.fc.in_features == 128
    assert sum(p.numel() for p in r10.parameters()) < 0.5 * sum(p.numel() for p in r18.parameters())
    assert build_model("resnet10", num_classes=5).fc.in_features == 512  # torchvision's widths without --width
    check_input_size("resnet10_cifar", 16, width=16, batch_size=1)


@pytest.mark.parametrize("name, message", [("vgg11_cifar", "for torchvision's ResNets"),
                                            ("resnet19_cifar", "not a torchvision classification model")])
def test_cifar_stem_on_a_model_that_is_not_a_resnet_is_one_line(name, message):
    with pytest.raises(ModelError, match=message):
        build_model(name, num_classes=10, image_size=32)
