"""Models by torchvision name, built for the image size they train on (`check_input_size` refuses a size a
model cannot take before any data is read), and what torchvision lacks for small images: ResNet width, a stem
that does not shrink the image 4x at once (`resnet18_cifar`), and ResNet-10 (one block a stage)."""

from __future__ import annotations

import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

from dalifeed.usage import first_line


class WidthResNet(ResNet):
    """torchvision's ResNet with stage widths (w, 2w, 4w, 8w) instead of (64, 128, 256, 512): the same blocks,
    `forward` and initialisation. On tiny images (digits, 32 px thumbnails) ResNet-18 at width 32 learns as
    well as at 64 with a quarter of the weights, and the backward pass of the 512-channel convolutions, which
    dominates on a CPU, shrinks with them."""

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


def cifar_stem(model: ResNet) -> ResNet:
    """Replace ResNet's ImageNet stem (7x7 stride-2 convolution, then a stride-2 max-pool: 4x smaller at once)
    with a 3x3 stride-1 convolution and no pooling, as ResNets for CIFAR do: on images of 8-32 px the first
    stage then sees every pixel instead of a quarter of them in each direction."""
    model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


class ModelError(ValueError):
    """An unknown model name, or an option the model does not have."""


def sized_by_builder(name: str) -> bool:
    """Whether the model's weights or layers are planned for one input size, given to its builder."""
    return name.startswith(("vit_", "maxvit_"))


def builder_options(name: str, image_size: int) -> dict:
    """What torchvision's builder of `name` needs besides the class count to train at `image_size`."""
    if name.startswith("vit_"):  # position embeddings: one per patch of an image of this size
        return {"image_size": image_size}
    if name.startswith("maxvit_"):  # window and grid partitions are planned for this size
        return {"input_size": (image_size, image_size)}
    if name in ("googlenet", "inception_v3"):
        # with their auxiliary heads they return (logits, aux...) in training, which no loss here takes;
        # init_weights=True is what torchvision does by default (it only warns that it will change)
        return {"aux_logits": False, "init_weights": True}
    return {}


CIFAR_SUFFIX = "_cifar"  # resnet18_cifar: resnet18 with `cifar_stem`

# ResNets torchvision has no builder for: name -> (block, blocks in each of the four stages). ResNet-10 is
# ResNet-18 with one block a stage instead of two: half the layers, and half the time of a training step on
# images as small as the demo's digits (docs/training.md).
MORE_RESNETS = {"resnet10": (BasicBlock, [1, 1, 1, 1])}


def build_model(name: str, num_classes: int, width: int | None = None, image_size: int = 224) -> nn.Module:
    """`torchvision.models.get_model(name)` with fresh weights, built for `image_size` where the model's
    shape depends on it (ViT, MaxViT); `width` rebuilds a ResNet at that width. A ResNet's name with the
    suffix `_cifar` (resnet18_cifar) gives it `cifar_stem`, for images of 8-32 px."""
    if name.endswith(CIFAR_SUFFIX):
        model = build_model(name.removesuffix(CIFAR_SUFFIX), num_classes, width, image_size)
        if not isinstance(model, ResNet):
            raise ModelError(f"--model {name}: the {CIFAR_SUFFIX} stem is for torchvision's ResNets "
                             f"(e.g. resnet18{CIFAR_SUFFIX}), not {name.removesuffix(CIFAR_SUFFIX)}")
        return cifar_stem(model)
    if name in MORE_RESNETS:
        block, layers = MORE_RESNETS[name]
        return (ResNet(block, layers, num_classes=num_classes) if width is None
                else WidthResNet(block, layers, width, num_classes))
    classifiers = torchvision.models.list_models(torchvision.models)  # not detection, video, ... models
    if name not in classifiers:
        names = ", ".join([*MORE_RESNETS, *(n for n in classifiers if n.startswith("resnet"))])
        raise ModelError(f"--model {name!r}: not a torchvision classification model nor "
                         f"{' / '.join(MORE_RESNETS)} (e.g. {names})")
    builder = torchvision.models.get_model_builder(name)
    model = builder(weights=None, num_classes=num_classes, **builder_options(name, image_size))
    if width is None:
        return model
    if type(model) is not ResNet or (model.groups, model.base_width) != (1, 64):
        raise ModelError(f"--width applies to torchvision's plain ResNets (resnet18 ... resnet152), not {name}")
    layers = [len(model.layer1), len(model.layer2), len(model.layer3), len(model.layer4)]
    return WidthResNet(type(model.layer1[0]), layers, width, num_classes)


def check_input_size(name: str, image_size: int, width: int | None = None, batch_size: int = 2) -> None:
    """Raise ModelError, in one line, if `name` cannot train on batches of `batch_size` (per rank) `image_size`
    square images: the model is built on the meta device (shapes only: no memory, no arithmetic) and a
    training-mode batch of that size goes through it, so that a bad combination is refused before any data
    is read rather than at the first batch. The batch matters only to BatchNorm, which in training needs
    more than one value per channel (batch x height x width > 1): a batch of one fails where a layer's
    output shrinks to 1x1 (ResNet-18 at 32 px: its last stage), a batch of two never does."""
    try:
        model = build_on_meta(name, image_size, width)
    except ModelError:
        raise
    except NotImplementedError:  # regnets compute their widths with .tolist(), which meta tensors refuse;
        return  # they pool adaptively and take any size from 8 px
    except Exception as e:  # the builder refuses the size (ViT: not a multiple of the patch)
        raise ModelError(size_refused(name, image_size, first_line(e))) from None
    problem = forward_problem(model, image_size, batch_size)
    if problem is None:
        return
    if batch_size == 1 and forward_problem(model, image_size, 2) is None:  # only BatchNorm's rule (docstring)
        smallest = smallest_size(model, image_size, batch_size)
        larger = f" or --image-size >= {smallest}" if smallest is not None else ""
        raise ModelError(f"--batch-size 1 with --image-size {image_size}: a BatchNorm layer of {name} sees one value "
                         f"per channel in training (the image shrinks to 1x1 there); use --batch-size >= 2{larger}")
    if not sized_by_builder(name):  # one model for all sizes: find the smallest it takes
        smallest = smallest_size(model, image_size, batch_size)
        if smallest is not None:
            raise ModelError(f"--model {name} needs --image-size >= {smallest}, got {image_size} (smaller images "
                             f"shrink to nothing in its layers)")
    raise ModelError(size_refused(name, image_size, problem))


def check_other_sizes(name: str, image_size: int, sizes: dict[int, str], width: int | None = None,
                      batch_size: int = 2) -> None:
    """Raise ModelError, in one line, if `name` built for `image_size` (which `check_input_size` has passed)
    cannot take one of `sizes` (size -> the option that asks for it: a progressive-resize epoch, validation's
    size): ResNets and other pooling models take them all, a ViT built for one size takes no other."""
    sizes = {size: what for size, what in sizes.items() if size != image_size}
    if not sizes:
        return
    try:
        model = build_on_meta(name, image_size, width)
    except NotImplementedError:  # regnets: see check_input_size
        return
    for size, what in sorted(sizes.items()):
        problem = forward_problem(model, size, batch_size)
        if problem is not None:
            hint = (" (a model built for one size: train and evaluate at --image-size)" if sized_by_builder(name)
                    else "")
            raise ModelError(f"--model {name} (built for --image-size {image_size}) cannot take {what}, {size} px: "
                             f"{problem.rstrip('.')}{hint}")


def build_on_meta(name: str, image_size: int, width: int | None = None) -> nn.Module:
    with torch.device("meta"):
        return build_model(name, 2, width, image_size).train()


def forward_problem(model: nn.Module, image_size: int, batch_size: int = 2) -> str | None:
    """Why a training-mode forward pass of `batch_size` `image_size` images fails or returns no logits (of the
    model's 2 classes); None if fine."""
    try:
        with torch.no_grad():
            out = model(torch.empty(batch_size, 3, image_size, image_size, device="meta"))
    except Exception as e:  # torch's shape checks: "Output size is too small", "Kernel size can't be greater" and
        return first_line(e)  # BatchNorm's "Expected more than 1 value per channel when training"
    if not isinstance(out, torch.Tensor) or out.shape != (batch_size, 2):
        return f"it returns {type(out).__name__} in training, not a batch of logits"
    return None


def smallest_size(model: nn.Module, failed: int, batch_size: int = 2, largest: int = 1024) -> int | None:
    """The smallest image size above `failed` that `model` takes in batches of `batch_size` (bisection: for
    convolution and pooling stacks a larger image never fails where a smaller one passed), or None if even
    `largest` fails."""
    if forward_problem(model, largest, batch_size) is not None:
        return None
    lo, hi = failed, largest  # lo fails, hi works
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if forward_problem(model, mid, batch_size) is None else (mid, hi)
    return hi


def size_refused(name: str, image_size: int, reason: str) -> str:
    """The one-line refusal of `image_size` for `name`, with the sizes that work where they are known."""
    if name.startswith("vit_"):
        patch = build_on_meta(name, 224).patch_size
        near = [s for s in (image_size // patch * patch, (image_size // patch + 1) * patch) if s >= 8]
        return (f"--model {name} needs an --image-size divisible by its patch size {patch} "
                f"(e.g. {' or '.join(map(str, near))}), got {image_size}")
    works = image_size != 224 and forward_problem(build_on_meta(name, 224), 224) is None
    return (f"--model {name} cannot take --image-size {image_size}: {reason.rstrip('.')}"
            + ("; 224 works" if works else ""))
