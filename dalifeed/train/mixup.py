"""Mixup and CutMix on a batch on the device, as torchvision's `transforms.v2.MixUp` / `CutMix` do them, with
random numbers that depend only on (seed, rank, epoch, step).

torchvision's semantics (transforms/v2/_augment.py): lambda ~ Beta(alpha, alpha) per batch; each image is mixed
with its neighbour in the batch (`roll(1, 0)`), mixup as `lam * x + (1 - lam) * x_rolled`, cutmix by pasting a
box of the rolled batch of area about (1 - lam) of the image (centre uniform, clipped at the borders) and
setting lam to the area actually kept; targets are `lam * one_hot(y) + (1 - lam) * one_hot(y_rolled)`. With
both on, torchvision's reference (`RandomChoice([mixup, cutmix])`) picks one per batch with probability 0.5,
which is `switch_prob` here. Label smoothing stays in the loss (`soft_cross_entropy`), as in the reference.

Determinism: torchvision draws from torch's global generator, so a resumed run would mix differently. Here
each batch draws from its own `numpy.random.Generator` seeded with (seed, rank, epoch, step) (numpy, because
torch's Beta and Gamma samplers take no generator): the batch of a resumed step is mixed exactly as it was in
an uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MixDraw:
    """What one batch's mixing drew: `kind` "mixup" or "cutmix", lam (for cutmix, the kept area), and the
    pasted box (y1, y2, x1, x2) for cutmix."""

    kind: str
    lam: float
    box: tuple[int, int, int, int] | None = None


@dataclass(frozen=True)
class BatchMixer:
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    seed: int = 0
    rank: int = 0
    switch_prob: float = 0.5  # with both on: the probability of cutmix for a batch

    def __post_init__(self) -> None:
        if self.mixup_alpha < 0 or self.cutmix_alpha < 0:
            raise ValueError(f"mixup and cutmix alphas must be >= 0, got {self.mixup_alpha}, {self.cutmix_alpha}")
        if not 0 <= self.switch_prob <= 1:
            raise ValueError(f"switch_prob must be in [0, 1], got {self.switch_prob}")

    @property
    def enabled(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def generator(self, epoch: int, step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.rank, epoch, step])

    def draw(self, epoch: int, step: int, height: int, width: int) -> MixDraw:
        """The mixing of batch `step` of `epoch` for images of height x width."""
        rng = self.generator(epoch, step)
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha == 0 or rng.random() < self.switch_prob)
        if not use_cutmix:
            return MixDraw("mixup", float(rng.beta(self.mixup_alpha, self.mixup_alpha)))
        lam = float(rng.beta(self.cutmix_alpha, self.cutmix_alpha))
        # torchvision's CutMix._get_params
        r_x, r_y = int(rng.integers(width)), int(rng.integers(height))
        r = 0.5 * np.sqrt(1.0 - lam)
        r_w_half, r_h_half = int(r * width), int(r * height)
        x1, y1 = max(r_x - r_w_half, 0), max(r_y - r_h_half, 0)
        x2, y2 = min(r_x + r_w_half, width), min(r_y + r_h_half, height)
        kept = 1.0 - (x2 - x1) * (y2 - y1) / (width * height)
        return MixDraw("cutmix", float(kept), (y1, y2, x1, x2))

    def mix_images(self, images: torch.Tensor, epoch: int, step: int) -> tuple[torch.Tensor, MixDraw]:
        """Batch `step` of `epoch` mixed (images (B, C, H, W) in any memory format), and what was drawn."""
        draw = self.draw(epoch, step, images.shape[-2], images.shape[-1])
        rolled = images.roll(1, 0)
        if draw.kind == "mixup":
            return rolled.mul_(1.0 - draw.lam).add_(images.mul(draw.lam)), draw
        y1, y2, x1, x2 = draw.box
        images = images.clone()
        images[..., y1:y2, x1:x2] = rolled[..., y1:y2, x1:x2]
        return images, draw

    @staticmethod
    def mix_targets(labels: torch.Tensor, draw: MixDraw, num_classes: int) -> torch.Tensor:
        """Soft targets (B, num_classes) float32 of a batch mixed by `draw`: each row sums to 1."""
        targets = one_hot(labels, num_classes)
        return targets.roll(1, 0).mul_(1.0 - draw.lam).add_(targets.mul(draw.lam))

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int, epoch: int,
                 step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, soft targets) of batch `step` of `epoch` (off: the images and one-hot targets)."""
        if not self.enabled:
            return images, one_hot(labels, num_classes)
        images, draw = self.mix_images(images, epoch, step)
        return images, self.mix_targets(labels, draw, num_classes)


def one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(B, num_classes) float32 one-hot rows of `labels`. Not `F.one_hot`, whose CPU kernel reads the labels'
    range on the host (aten/src/ATen/native/Onehot.cpp): on a CPU run that read would hide among the ones the
    sync test counts."""
    return torch.zeros(labels.shape[0], num_classes, device=labels.device).scatter_(1, labels.long()[:, None], 1.0)


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy against class probabilities (B, K), smoothed as torch smooths them:
    (1 - eps) * targets + eps / K."""
    return F.cross_entropy(logits.float(), targets.float(), label_smoothing=label_smoothing)
