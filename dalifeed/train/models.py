"""Models by torchvision name, and the one knob torchvision lacks for small images: ResNet width."""

from __future__ import annotations

import torchvision
from torch import nn
from torchvision.models.resnet import ResNet


class WidthResNet(ResNet):
    """torchvision's ResNet with stage widths (w, 2w, 4w, 8w) instead of (64, 128, 256, 512): the same blocks,
    `forward` and initialisation. On tiny images (digits, 32 px thumbnails) ResNet-18 at width 32 learns as
    well as at 64 with a quarter of the weights, and trains 4x faster on a CPU, where the backward pass of
    the 512-channel convolutions dominates."""

    def __init__(self, block, layers: list[int], width: int, num_classes: int):
        super().__init__(block, layers, num_classes=num_classes)
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = self._norm_layer(width)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for m in self.modules():  # torchvision's initialisation, for the layers replaced above
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)


class ModelError(ValueError):
    """An unknown model name, or an option the model does not have."""


def build_model(name: str, num_classes: int, width: int | None = None) -> nn.Module:
    """`torchvision.models.get_model(name)` with fresh weights; `width` rebuilds a ResNet at that width."""
    try:
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    except ValueError:
        names = ", ".join(n for n in torchvision.models.list_models(torchvision.models) if n.startswith("resnet"))
        raise ModelError(f"--model {name!r}: not a torchvision classification model (e.g. {names})") from None
    if width is None:
        return model
    if type(model) is not ResNet or (model.groups, model.base_width) != (1, 64):
        raise ModelError(f"--width applies to torchvision's plain ResNets (resnet18 ... resnet152), not {name}")
    layers = [len(model.layer1), len(model.layer2), len(model.layer3), len(model.layer4)]
    return WidthResNet(type(model.layer1[0]), layers, width, num_classes)
