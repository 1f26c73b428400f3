"""Automatic augmentation policies and random erasing in the DALI graph, with torchvision's semantics.

`train_augment` (graphs.py) calls `apply_policy` on the uint8 HWC images after RandomResizedCrop (before the
fused flip + normalise) and `random_erase` on the normalised float32 output (cast to float16 after it when the
loader hands out float16: ERASE_DTYPE), which is where torchvision's ClassificationPresetTrain puts
`AutoAugment` / `RandAugment` / `TrivialAugmentWide` and `RandomErasing`. The one difference in order:
torchvision flips before the policy, we flip after it (in crop_mirror_normalize, fused with the normalisation);
every policy draws its signed magnitudes with random sign, so the two orders give the same distribution of
images.

The operations are DALI's (five written again: `_current_ops`); what each policy does with them is
torchvision's, not DALI's own suites, whose policies, translations, ranges and fill differ (docs/pipelines.md).
`torchvision_space` below writes torchvision's magnitude bins out and `dali_op` maps its operations to DALI's.

The policies choose an operation per sample with `if` in the graph: the pipeline needs
`enable_conditionals=True`, which `graphs.shard_pipeline` turns on only when a policy is set. AutoAugment runs
DALI's `apply_auto_augment`; RandAugment and TrivialAugmentWide run DALI's choice with their five geometric
operations folded into one warp (`apply_rand_augment_one_warp`, `apply_trivial_augment_one_warp`), which
gives DALI's images bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from nvidia.dali import fn, types
from nvidia.dali import math as dmath
from nvidia.dali.pipeline import do_not_convert

from .names import POLICIES

RANDOM_ERASE_SCALE = (0.02, 0.33)  # torchvision's RandomErasing defaults: the erased area as a fraction
RANDOM_ERASE_RATIO = (0.3, 3.3)  # and its aspect ratio (h / w), drawn log-uniform
RANDOM_ERASE_ATTEMPTS = 10  # torchvision's: an image whose 10 draws all fall outside it is left as it is
AUTO_AUGMENT_BINS = 10  # torchvision's AutoAugment indexes magnitude bins 0..9 of 10
DEFAULT_BINS = 31  # RandAugment's and TrivialAugmentWide's num_magnitude_bins



IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class AugmentConfig:
    """What the training and validation graphs do to each image; the defaults are torchvision's ImageNet
    recipe. How images are decoded and handed out (dtype, layout, the hardware decoder's share) is the
    loader's business, not the augmentation's.

    Training: a random resized crop to `image_size`, a random horizontal flip, the `auto_augment` policy,
    normalisation, random erasing. Validation: the shorter side resized to `val_shorter_side`, a centre crop
    of `image_size`, normalisation. The values are checked when the config is made.

    Example:
        ```python
        from dalifeed.pipelines import AugmentConfig, make_loader

        augment = AugmentConfig(image_size=176, auto_augment="ta_wide", random_erase=0.1)
        loader = make_loader("/data/shards", "train", 256, augment=augment)
        ```

    Attributes:
        image_size: The side in px of the square images handed out (training's crop, validation's centre
            crop). At least 8. Default 224.
        crop_scale: RandomResizedCrop's area range (MIN, MAX), fractions of the image's area,
            0 < MIN <= MAX <= 1. Default (0.08, 1.0).
        crop_ratio: RandomResizedCrop's aspect-ratio range (width / height). Default (3/4, 4/3).
        flip: A random horizontal flip in training, with probability 0.5. Default True.
        val_crop_fraction: Validation's centre crop as a fraction of the resized shorter side: the shorter
            side is resized to `image_size / val_crop_fraction` (256 for 224) unless `val_resize` says.
            Default 0.875.
        val_resize: Validation's shorter side in px before the centre crop, at least `image_size`; None:
            `image_size / val_crop_fraction`. Default None.
        mean: Per-channel (R, G, B) mean subtracted after scaling pixels to [0, 1]. Default ImageNet's
            (0.485, 0.456, 0.406).
        std: Per-channel (R, G, B) standard deviation divided by after the mean. Default ImageNet's
            (0.229, 0.224, 0.225).
        auto_augment: An augmentation policy, torchvision's, run in the DALI graph: `"imagenet"`
            (AutoAugment), `"ra"` (RandAugment), `"ta_wide"` (TrivialAugmentWide); None: none. Default None.
        ra_magnitude: RandAugment's magnitude bin of every operation, 0 to 30. Default 9.
        ra_num_ops: RandAugment's operations per image, at least 1. Default 2.
        random_erase: The probability, 0 to 1, of erasing a random rectangle (2-33% of the image, aspect ratio
            0.3 to 3.3) to 0 after normalising, as torchvision's RandomErasing. Default 0.0.

    Raises:
        ValueError: A value outside its range, named.
    """

    image_size: int = 224
    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True
    val_crop_fraction: float = 0.875
    val_resize: int | None = None
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    auto_augment: str | None = None
    ra_magnitude: int = 9
    ra_num_ops: int = 2
    random_erase: float = 0.0

    def __post_init__(self) -> None:
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < min <= max <= 1, got {self.crop_scale}")
        if self.image_size < 8:
            raise ValueError(f"image_size must be >= 8, got {self.image_size}")
        if self.val_resize is not None and self.val_resize < self.image_size:
            raise ValueError(f"val_resize {self.val_resize} must be >= image_size {self.image_size}: the "
                             f"centre crop is taken from the resized image")
        if self.auto_augment not in (None, *POLICIES):
            raise ValueError(f"auto_augment must be one of {', '.join(POLICIES)} or None, "
                             f"got {self.auto_augment!r}")
        if not 0 <= self.ra_magnitude < DEFAULT_BINS:
            raise ValueError(f"ra_magnitude must be in [0, {DEFAULT_BINS - 1}], got {self.ra_magnitude}")
        if self.ra_num_ops < 1:
            raise ValueError(f"ra_num_ops must be >= 1, got {self.ra_num_ops}")
        if not 0 <= self.random_erase <= 1:
            raise ValueError(f"random_erase must be in [0, 1], got {self.random_erase}")

    @property
    def val_shorter_side(self) -> int:
        """The side in px validation resizes the shorter side to before its centre crop of `image_size`."""
        if self.val_resize is not None:
            return self.val_resize
        return int(self.image_size / self.val_crop_fraction)


def _linspace(lo: float, hi: float, bins: int) -> np.ndarray:
    """torch.linspace in float32, as torchvision computes its bins: float64 puts TrivialAugment's 15 * 32 / 30
    at exactly 16 pixels where torchvision's 15.999999 translates by int() = 15."""
    import torch  # here, not at the top: the command lines' --help imports this module for POLICIES

    return torch.linspace(lo, hi, bins).double().numpy()


def _posterize_bits(bins: int, span: int, top: int = 8) -> np.ndarray:
    """torchvision's `(top - arange(bins) / ((bins - 1) / span)).round().int()`: bits kept per bin."""
    import torch

    return (top - (torch.arange(bins) / ((bins - 1) / span))).round().double().numpy()


def torchvision_space(policy: str, size: int, bins: int | None = None) -> dict[str, tuple[np.ndarray | None, bool]]:
    """Operation name -> (magnitude of each bin, or None; whether the sign is drawn at random), as torchvision's
    `_AUGMENTATION_SPACE` of the policy's class gives them for a `size` x `size` image: magnitudes in
    torchvision's units (shears as tangents, translations in pixels before `int()`, angles in degrees, enhance
    factors minus 1, bits kept, solarize thresholds as fractions of 255)."""
    bins = bins or (AUTO_AUGMENT_BINS if policy == "imagenet" else DEFAULT_BINS)
    if policy == "ta_wide":
        shear, translate, rotate, enhance, poster_span = 0.99, 32.0, 135.0, 0.99, 6
    else:  # RandAugment and AutoAugment share one table (AutoAugment adds Invert and has no Identity)
        shear, translate, rotate, enhance, poster_span = 0.3, 150.0 / 331.0 * size, 30.0, 0.9, 4
    space = {
        "Identity": (None, False),
        "ShearX": (_linspace(0.0, shear, bins), True),
        "ShearY": (_linspace(0.0, shear, bins), True),
        "TranslateX": (_linspace(0.0, translate, bins), True),
        "TranslateY": (_linspace(0.0, translate, bins), True),
        "Rotate": (_linspace(0.0, rotate, bins), True),
        "Brightness": (_linspace(0.0, enhance, bins), True),
        "Color": (_linspace(0.0, enhance, bins), True),
        "Contrast": (_linspace(0.0, enhance, bins), True),
        "Sharpness": (_linspace(0.0, enhance, bins), True),
        "Posterize": (_posterize_bits(bins, poster_span), False),
        "Solarize": (_linspace(1.0, 0.0, bins), False),
        "AutoContrast": (None, False),
        "Equalize": (None, False),
    }
    if policy == "imagenet":
        del space["Identity"]
        space["Invert"] = (None, False)
    elif policy not in POLICIES:
        raise ValueError(f"auto_augment must be one of {', '.join(POLICIES)}, got {policy!r}")
    return space


# torchvision's AutoAugmentPolicy.IMAGENET: (operation, probability, magnitude bin) pairs, one chosen per image
TORCHVISION_IMAGENET_POLICY = [
    (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
    (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Equalize", 0.4, None), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, None)),
    (("Posterize", 0.8, 5), ("Equalize", 1.0, None)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
    (("Equalize", 0.6, None), ("Posterize", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
    (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
    (("Equalize", 0.0, None), ("Equalize", 0.8, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
    (("Sharpness", 0.4, 7), ("Invert", 0.6, None)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, None)),
    (("Color", 0.4, 0), ("Equalize", 0.6, None)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
]


# torchvision's shear by tangent m (about the top-left corner) is DALI's fn.transforms.shear by -m: on photos,
# -m gives the same images and +m does not (tests/test_recipes.py)
def _shear_x(m):
    return [-m, 0.0]


def _shear_y(m):
    return [0.0, -m]


def _translate_x(m):
    return [float(math.trunc(m)), 0.0]  # torchvision shifts by int(magnitude) pixels


def _translate_y(m):
    return [0.0, float(math.trunc(m))]


def _solarize_threshold(m):
    return np.float32(255.0 * m)  # torchvision: threshold = 255 * magnitude for uint8 images


def _enhance_factor(m):
    return 1.0 + m  # torchvision: factor 1 + magnitude (the sign drawn at random)


def _current_ops():
    """Five of DALI 2.4's augmentations written again, with the same operators on either device:

    - `equalize` and `sharpness` call fn.experimental.equalize / filter, deprecated aliases of fn.equalize /
      fn.filter (tests/test_gpu_graphs.py refuses deprecated operators): the same on the current operators.
    - `solarize` in half the element passes, so in less CPU than DALI's, the same images bit for bit
      (tests/test_recipes.py).
    - `color` and `contrast` without float -> uint8 conversions (`_blend_uint8`): less CPU than DALI's, and
      closer to torchvision's images than DALI's (tests/test_recipes.py; the costs: docs/benchmarks.md)."""
    from nvidia.dali.auto_aug import augmentations as a
    from nvidia.dali.auto_aug.core import augmentation

    @augmentation
    def equalize(data, _):
        return fn.equalize(data)  # OpenCV's histogram equalisation (PIL's lookup table rounds differently)

    @augmentation(mag_range=(0, 0.9), randomly_negate=True, mag_to_param=a.sharpness_kernel, param_device="auto")
    def sharpness(data, kernel):
        return fn.filter(data, kernel)  # PIL's smoothing kernel; PIL also leaves the 1 px border as it was

    @augmentation(mag_range=(256, 0), param_device="auto")
    def solarize(data, threshold):
        # 255 - x is x ^ 255 on uint8: three element passes instead of DALI's six, on either device
        return data ^ ((data >= threshold) * types.Constant(np.uint8(255)))

    @augmentation(mag_range=(0, 0.9), randomly_negate=True, mag_to_param=_enhance_factor)
    def color(data, factor):
        # PIL's Color: blend the image with its grey (ITU-R 601 luma) by `factor`
        grey = fn.color_space_conversion(data, image_type=types.RGB, output_type=types.GRAY)
        # (1 - factor) * (grey - 1/2) - 1/2: torchvision floors the grey and the blend, rounding would not
        # (brightness_shift counts in int16's largest value)
        rest = fn.brightness_contrast(grey, contrast=1.0 - factor, contrast_center=0.0,
                                      brightness_shift=(0.5 * factor - 1.0) / INT16_MAX, dtype=types.INT16)
        return _blend_uint8(data, factor, rest)

    @augmentation(mag_range=(0, 0.9), randomly_negate=True, mag_to_param=_enhance_factor)
    def contrast(data, factor):
        # PIL's Contrast: blend the image with its mean grey by `factor` (DALI's way to the mean, which stays
        # on the image's device: an operator's arguments live on the CPU)
        mean = fn.reductions.mean(data, axis_names="HW", keep_dims=True)
        grey = fn.reductions.sum(mean * types.Constant(np.float32([0.299, 0.587, 0.114])), axis_names="C",
                                 keep_dims=True)
        # (1 - factor) * (grey - 1/2) - 1/2: torchvision floors the grey and the blend, rounding would not
        return _blend_uint8(data, factor, fn.cast((grey - 0.5) * (1.0 - factor) - 0.5, dtype=types.INT16))

    return {"Equalize": equalize, "Sharpness": sharpness, "Solarize": solarize, "Color": color, "Contrast": contrast}


INT16_MAX = 32767


def _blend_uint8(data, factor, rest):
    """uint8 `data * factor + rest` (`rest`: int16, the other image's share, broadcast over the channels), in
    the passes DALI's CPU kernels make fast: brightness_contrast reads uint8 at the speed of a copy whatever
    it writes, and int16 -> uint8 is a cheap saturating cast, where DALI's own Color and Contrast compute in
    float and convert float -> uint8 element by element (the conversion is most of what a float `x * s` ->
    uint8 costs). Each share is rounded: within half a grey level of torchvision's on average at every
    magnitude, where DALI's own ops were further from it (tests/test_recipes.py)."""
    share = fn.brightness_contrast(data, contrast=factor, contrast_center=0.0, dtype=types.INT16)
    return fn.cast(share + rest, dtype=types.UINT8)


def _precomputed_augmentation_cls():
    """DALI's `Augmentation` with its magnitude -> parameter tables computed as plain Python, once per table.

    DALI maps every magnitude bin of every operation (both signs) through `mag_to_param` while the graph is
    defined, and with conditionals on (every policy) AutoGraph converts that mapping too: each of the ~600
    little numpy calls of a TrivialAugmentWide suite went through `converted_call` and its source-map
    bookkeeping, most of what defining a policy's graph costs, on the cores the loader decodes on (issue 29,
    docs/benchmarks.md "Where a policy's time goes").
    The tables hold no DALI nodes (DALI refuses a `mag_to_param` that returns one), so converting them buys
    nothing, and the same table gives the same constant: cached by operation and magnitudes. `_get_param` reads
    the parameter with a lookup instead of a constant table (`_lookup_param`). The methods overridden and the
    names read are DALI 2.4's (`auto_aug/core/_augmentation.py`); a DALI that renames them only loses the
    speed-up."""
    from nvidia.dali.auto_aug.core import _Augmentation as Augmentation  # what `augmentation_cls` extends
    from nvidia.dali.auto_aug.core import _augmentation

    SignedMagnitudeBin = getattr(_augmentation, "_SignedMagnitudeBin", None)

    class PrecomputedAugmentation(Augmentation):
        _tables: dict = {}

        @do_not_convert
        def _map_mag_to_param(self, magnitude):
            key = (self.name, self.mag_to_param, float(magnitude))
            if key not in self._tables:
                self._tables[key] = Augmentation._map_mag_to_param(self, magnitude)
            return self._tables[key]

        @do_not_convert
        def _map_mags_to_params(self, magnitudes):
            key = (self.name, self.mag_to_param, tuple(float(m) for m in magnitudes))
            if key not in self._tables:
                self._tables[key] = Augmentation._map_mags_to_params(self, magnitudes)
            return self._tables[key]

        @do_not_convert
        def _get_param(self, magnitude_bin, num_magnitude_bins, param_device):
            table, index = (None, None) if SignedMagnitudeBin is None else \
                self._table_and_index(magnitude_bin, num_magnitude_bins)
            param = _lookup_param(table, index) if table is not None and self.param_device == "cpu" else None
            if param is None:
                return Augmentation._get_param(self, magnitude_bin, num_magnitude_bins, param_device)
            return param

        def _table_and_index(self, magnitude_bin, num_magnitude_bins):
            """(the parameter of every signed bin, the per-sample index into it) where DALI's `_get_param`
            would index a constant table with a batch; (None, None) where it does something else."""
            magnitudes = self._get_magnitudes(num_magnitude_bins)
            signed = isinstance(magnitude_bin, SignedMagnitudeBin)
            if magnitudes is None or magnitude_bin is None:
                return None, None
            if self.randomly_negate:
                if not signed:  # DALI draws the sign itself (and warns)
                    return None, None
                if isinstance(magnitude_bin.bin, int):
                    magnitudes, index = [magnitudes[magnitude_bin.bin]], magnitude_bin.random_sign
                else:
                    index = magnitude_bin.signed_magnitude_idx
                return self._map_mags_to_params(SignedMagnitudeBin._remap_to_signed_magnitudes(magnitudes)), index
            index = magnitude_bin.bin if signed else magnitude_bin
            return (None, None) if isinstance(index, int) else (self._map_mags_to_params(magnitudes), index)

    return PrecomputedAugmentation


def _lookup_param(table: np.ndarray, index):
    """`table[index]` per sample as one LookupTable on `index`, for float tables of scalars or pairs (None for
    other tables: the operation keeps DALI's way).

    DALI's `_get_param` makes it `types.Constant(table)[index]`. Under a policy's `if`s that is more operators
    than it looks: a node without inputs is made at the top of the graph for the whole batch, so every `if` on
    the way down to the operation's branch splits it again (4 splits in TrivialAugmentWide's tree of 14), and
    DALI's CPU executor spends time on every operator whatever it computes. `index` is already in the branch,
    so a lookup on it is one operator (a pair: two more, stacking index and index + len(table)). The policies'
    graphs lose about a sixth of their operators, and the CPU those cost (docs/benchmarks.md). Same values:
    the table in float32, as the constant held it."""
    if table.dtype.kind != "f" or table.ndim not in (1, 2) or (table.ndim == 2 and table.shape[1] != 2):
        return None
    values = table.astype(np.float32).T.ravel().tolist()  # column by column: key k + c * len(table)
    if table.ndim == 2:
        index = fn.stack(index, index + len(table))
    return fn.lookup_table(index, keys=list(range(len(values))), values=values, dtype=types.FLOAT)


_PRECOMPUTED = []  # the class, made on first use (imports DALI's auto_aug only when a policy is used)


@do_not_convert
def _augmentation_cls():
    # not converted: the first policy graph calls this under AutoGraph, which would otherwise convert the class
    # body with it (methods marked do_not_convert included) and leave converted methods in the cached class;
    # `_get_param` converted reads DataNodes through the conditionals' hooks, and a graph without conditionals
    # (a single operation) then fails
    if not _PRECOMPUTED:
        _PRECOMPUTED.append(_precomputed_augmentation_cls())
    return _PRECOMPUTED[0]


def dali_op(name: str, magnitudes: np.ndarray | None, signed: bool):
    """DALI's augmentation for torchvision's operation `name` with torchvision's magnitude bins."""
    from nvidia.dali.auto_aug import augmentations as a  # imports numpy-heavy helpers: only when a policy is used

    ours = _current_ops()
    if magnitudes is None:
        return {"Identity": a.identity, "AutoContrast": a.auto_contrast, "Equalize": ours["Equalize"],
                "Invert": a.invert}[name]
    base, to_param = {
        "ShearX": (a.shear_x, _shear_x), "ShearY": (a.shear_y, _shear_y),
        "TranslateX": (a.translate_x_no_shape, _translate_x), "TranslateY": (a.translate_y_no_shape, _translate_y),
        "Rotate": (a.rotate, None), "Brightness": (a.brightness, _enhance_factor),
        "Color": (ours["Color"], _enhance_factor), "Contrast": (ours["Contrast"], _enhance_factor),
        "Sharpness": (ours["Sharpness"], a.sharpness_kernel), "Posterize": (a.posterize, a.poster_mask_uint8),
        "Solarize": (ours["Solarize"], _solarize_threshold),
    }[name]
    kwargs = {"mag_to_param": to_param} if to_param is not None else {}
    return base.augmentation(mag_range=np.asarray(magnitudes), randomly_negate=signed,
                             augmentation_cls=_augmentation_cls(), **kwargs)


def dali_suite(policy: str, size: int, bins: int | None = None) -> list:
    return [dali_op(name, mags, signed) for name, (mags, signed) in torchvision_space(policy, size, bins).items()]


def dali_imagenet_policy(size: int):
    """torchvision's AutoAugment ImageNet policy as a DALI `Policy`.

    An operation torchvision runs with probability 0 (("Equalize", 0.0, None), on purpose) is left out of its
    sub-policy: torchvision never applies it, DALI pads a shorter sub-policy with an identity it never runs,
    so the images' distribution is the same, and DALI's `Policy` warns about every probability 0. Leaving
    it out beats silencing that warning with `warnings.catch_warnings`, which swaps the process's filters
    and is not thread-safe (the loader defines graphs on a background thread)."""
    from nvidia.dali.auto_aug.core import Policy

    space = torchvision_space("imagenet", size)
    ops = {name: dali_op(name, mags, signed) for name, (mags, signed) in space.items()}
    sub_policies = [[(ops[name], p, mag) for name, p, mag in sub if p > 0] for sub in TORCHVISION_IMAGENET_POLICY]
    return Policy(name="TorchvisionImageNetPolicy", num_magnitude_bins=AUTO_AUGMENT_BINS, sub_policies=sub_policies)


# torchvision's policies default to nearest-neighbour sampling and fill with 0 where a shear, translation or
# rotation uncovers the canvas
POLICY_WARP_ARGS = {"fill_value": 0, "interp_type": types.INTERP_NN}


def apply_policy(images, cfg: AugmentConfig):
    """`cfg.auto_augment` on uint8 HWC images of cfg.image_size squared (needs enable_conditionals)."""
    from nvidia.dali.auto_aug.auto_augment import apply_auto_augment

    size = cfg.image_size
    if cfg.auto_augment == "imagenet":
        return apply_auto_augment(dali_imagenet_policy(size), images, **POLICY_WARP_ARGS)
    if cfg.auto_augment == "ra":
        return apply_rand_augment_one_warp(images, size, n=cfg.ra_num_ops, m=cfg.ra_magnitude)
    if cfg.auto_augment == "ta_wide":
        return apply_trivial_augment_one_warp(images, size)
    raise ValueError(f"auto_augment must be one of {', '.join(POLICIES)}, got {cfg.auto_augment!r}")


# RandAugment's and TrivialAugmentWide's shears, translations and rotation: one nearest-neighbour warp each,
# next to each other in torchvision's list (Identity, ShearX, ..., Rotate, Brightness, ...)
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")


def source_matrix(name: str, magnitude: float, size: int) -> np.ndarray:
    """The 2 x 3 map from output to input pixel coordinates (warp_affine's default, `inverse_map=True`) of
    DALI's operation for torchvision's `name` at `magnitude` on a `size` x `size` image, in float32 as DALI
    computes it, so that one warp gives each operation's images bit for bit (tests/test_recipes.py):

    - shears and translations: the inverse of the fn.transforms.shear / translation matrix of the parameter
      `dali_op` gives them (DALI's shear_x ... translate_y_no_shape warp with it and `inverse_map=False`);
      exact in float32, a shear's by -sx, a translation's by -t;
    - Rotate: fn.rotate(angle=magnitude, keep_size=True)'s own map, `translation(size / 2) *
      rotation2D(deg2rad(angle)) * translation(-size / 2)` in float32 (DALI 2.4's rotate_params.h, with the
      products of `geom/mat.h` summed left to right)."""
    f32 = np.float32
    if name in ("ShearX", "ShearY"):
        sx, sy = (_shear_x if name == "ShearX" else _shear_y)(magnitude)
        return np.array([[1.0, -sx, 0.0], [-sy, 1.0, 0.0]], dtype=f32)
    if name in ("TranslateX", "TranslateY"):
        tx, ty = (_translate_x if name == "TranslateX" else _translate_y)(magnitude)
        return np.array([[1.0, 0.0, -tx], [0.0, 1.0, -ty]], dtype=f32)
    if name != "Rotate":
        raise ValueError(f"{name} is not one of {', '.join(GEOMETRIC)}")
    angle = f32(f32(magnitude) * f32(math.pi / 180))
    c, s, half = f32(math.cos(angle)), f32(math.sin(angle)), f32(size * 0.5)
    rotation = [[c, -s, f32(0)], [s, c, f32(0)], [f32(0), f32(0), f32(1)]]
    matrix = _mat3_f32([[f32(1), f32(0), half], [f32(0), f32(1), half], [f32(0), f32(0), f32(1)]], rotation)
    matrix = _mat3_f32(matrix, [[f32(1), f32(0), -half], [f32(0), f32(1), -half], [f32(0), f32(0), f32(1)]])
    return np.array(matrix[:2], dtype=f32)


def _mat3_f32(a, b):
    """a @ b for 3 x 3 float32 lists, each element's sum rounded step by step left to right (numpy's matmul
    may sum in another order, and the last bit decides a nearest-neighbour pixel now and then)."""
    f32 = np.float32
    out = []
    for i in range(3):
        row = []
        for j in range(3):
            total = f32(a[i][0] * b[0][j])
            total = f32(total + f32(a[i][1] * b[1][j]))
            row.append(f32(total + f32(a[i][2] * b[2][j])))
        out.append(row)
    return out


def geometric_table(policy: str, size: int, bins: int) -> np.ndarray:
    """float32 (len(GEOMETRIC) * 2 * bins, 6): row `g * 2 * bins + 2 * bin + sign` is the source matrix of
    GEOMETRIC[g] at magnitude bin `bin` (negated when `sign` is 1: DALI's signed magnitude index)."""
    space = torchvision_space(policy, size, bins)
    rows = [source_matrix(name, float(space[name][0][b]) * (-1.0 if sign else 1.0), size).ravel()
            for name in GEOMETRIC for b in range(bins) for sign in (0, 1)]
    return np.asarray(rows, dtype=np.float32)


def _source_matrices(table: np.ndarray, first: int, bins: int, op_idx, magnitude_bin):
    """Per sample, the source matrix in `table` (geometric_table's) of the geometric operation drawn (`op_idx`:
    the policy's operation index; `first`: that of GEOMETRIC[0]) at its signed magnitude bin, (2, 3) float32;
    what is looked up for the other operations is never used. Looked up before the branches, for every
    sample: one node carried down the `if`s to the warp instead of the indices and the lookup's constant
    (DALI splits every node a branch reads at each `if` above it)."""
    values = table.ravel().tolist()
    row = dmath.clamp((op_idx - first) * (2 * bins) + magnitude_bin.signed_magnitude_idx, 0, len(table) - 1)
    columns = types.Constant(np.arange(6, dtype=np.int32))
    matrix = fn.lookup_table(row * 6 + columns, keys=list(range(len(values))), values=values, dtype=types.FLOAT)
    return fn.reshape(matrix, shape=[2, 3])


def _one_warp(data, *, matrix, fill_value, interp_type, **_):
    """The five geometric operations as one branch: one warp_affine with the sample's matrix. In branches of
    their own each was a lookup, a transform and a warp behind four more `if`s per choice, whose splits and
    merges DALI's executor runs as operators of their own (docs/benchmarks.md, "Where a policy's
    time goes")."""
    return fn.warp_affine(data, matrix=matrix, fill_value=fill_value, interp_type=interp_type)


class _OneWarpSuite(NamedTuple):
    """A policy's operations in torchvision's order with GEOMETRIC folded into one `_one_warp` branch where
    they stand, made once per graph (RandAugment chooses from it `n` times)."""

    branches: list  # DALI's augmentations, `_one_warp` in place of the five
    branch_of: list[int]  # the branch of each of the policy's operations
    first: int  # the policy's index of GEOMETRIC[0]
    table: np.ndarray  # geometric_table's source matrices
    bins: int

    @classmethod
    def of(cls, policy: str, size: int, bins: int) -> _OneWarpSuite:
        names = list(torchvision_space(policy, size, bins))
        first = names.index(GEOMETRIC[0])
        if names[first:first + len(GEOMETRIC)] != list(GEOMETRIC):
            raise ValueError(f"{policy}: the geometric operations are not {GEOMETRIC} in a row")
        suite = dali_suite(policy, size, bins)
        branches = suite[:first] + [_one_warp] + suite[first + len(GEOMETRIC):]
        branch_of = [i if i < first else max(first, i - len(GEOMETRIC) + 1) for i in range(len(names))]
        return cls(branches, branch_of, first, geometric_table(policy, size, bins), bins)


def _select(branches: list, index, lo: int, hi: int, **kwargs):
    """branches[index](**kwargs) per sample: a balanced tree of `if`s, as DALI's auto_aug `select`."""
    if lo == hi:
        return branches[lo](**kwargs)
    mid = (lo + hi) // 2
    if index <= mid:
        return _select(branches, index, lo, mid, **kwargs)
    else:
        return _select(branches, index, mid + 1, hi, **kwargs)


def _apply_one_warp(suite: _OneWarpSuite, data, op_idx, magnitude_bin):
    """One choice per sample among the suite's branches."""
    branch = fn.lookup_table(op_idx, keys=list(range(len(suite.branch_of))), values=suite.branch_of,
                             dtype=types.INT32)
    matrix = _source_matrices(suite.table, suite.first, suite.bins, op_idx, magnitude_bin)
    return _select(suite.branches, branch, 0, len(suite.branches) - 1, data=data, matrix=matrix,
                   magnitude_bin=magnitude_bin, num_magnitude_bins=suite.bins, **POLICY_WARP_ARGS)


def apply_rand_augment_one_warp(data, size: int, n: int, m: int):
    """DALI's `apply_rand_augment(dali_suite("ra", size), data, n, m, DEFAULT_BINS)` with the same random
    draws (the same operators, made in the same order), and the geometric operations folded into one warp:
    the same images, bit for bit (tests/test_recipes.py). `n` >= 1 and `m` in 0..30: AugmentConfig checks
    both."""
    from nvidia.dali.auto_aug.core import signed_bin

    suite = _OneWarpSuite.of("ra", size, DEFAULT_BINS)
    shape = tuple() if n == 1 else (n,)
    op_idx = fn.random.uniform(values=list(range(len(suite.branch_of))), shape=shape, dtype=types.INT32)
    magnitude_bin = signed_bin(m, shape=shape)
    for level in range(n):
        level_bin, level_op = (magnitude_bin, op_idx) if n == 1 else (magnitude_bin[level], op_idx[level])
        data = _apply_one_warp(suite, data, level_op, level_bin)
    return data


def apply_trivial_augment_one_warp(data, size: int):
    """DALI's `apply_trivial_augment(dali_suite("ta_wide", size), data, DEFAULT_BINS)` with the same random
    draws and the geometric operations folded into one warp: the same images, bit for bit."""
    from nvidia.dali.auto_aug.core import signed_bin

    suite = _OneWarpSuite.of("ta_wide", size, DEFAULT_BINS)
    magnitude_bin = signed_bin(fn.random.uniform(values=list(range(DEFAULT_BINS)), dtype=types.INT32))
    op_idx = fn.random.uniform(values=list(range(len(suite.branch_of))), dtype=types.INT32)
    return _apply_one_warp(suite, data, op_idx, magnitude_bin)


def _round(x):
    return dmath.floor(x + 0.5)  # Python's round() differs only at exact halves, which a float draw never hits


def random_erase_box(side: int, probability: float):
    """torchvision's `RandomErasing.get_params` for a `side` x `side` image, per sample, as CPU nodes:
    (anchor (y, x), shape (h, w)) as floats; shape (0, 0) when the image is not erased (probability
    1 - `probability`, or no draw of 10 fitted the image).

    Written in few operators, each over all 10 draws at once: DALI's CPU executor spends about as much on a
    scalar operator as on its arithmetic, and a box written draw by draw and side by side took about twice
    the operators and twice the time of this one (docs/benchmarks.md)."""
    n = RANDOM_ERASE_ATTEMPTS
    area = float(side * side)
    erased_area = fn.random.uniform(range=[s * area for s in RANDOM_ERASE_SCALE], shape=[n])  # area * scale
    log_ratio = fn.random.uniform(range=[math.log(r) for r in RANDOM_ERASE_RATIO], shape=[n])
    # rows h and w of every draw: round(sqrt(area * scale * ratio ** (+1, -1)))
    signs = types.Constant(np.float32([[1.0], [-1.0]]))
    sides = _round(dmath.sqrt(erased_area * dmath.exp(signs * log_ratio)))
    # the first draw with h < side and w < side, as torchvision's loop takes it, n when none fits: the smallest
    # of (k if draw k fits else k + n)
    too_big = fn.lookup_table(fn.cast(fn.reductions.max(sides, axes=[0]), dtype=types.INT32),
                              keys=list(range(side)), values=[0.0] * side, default_value=float(n))
    first = fn.reductions.min(types.Constant(np.arange(n, dtype=np.float32)) + too_big)
    # column n, added as zeros, is (h, w) = (0, 0): nothing fitted, torchvision leaves the image as it is
    fitted = fn.pad(sides, axes=[1], shape=[n + 1], fill_value=0.0)
    shape = fitted[:, fn.cast(first, dtype=types.INT32)] * fn.random.coin_flip(probability=probability)
    # torchvision: i = randint(0, side - h + 1), j = randint(0, side - w + 1)
    room = side - shape
    anchor = dmath.min(dmath.floor(fn.random.uniform(range=[0.0, 1.0], shape=[2]) * (room + 1.0)), room)
    return anchor, shape


# The type erasing runs in. DALI 2.4's GPU erase is instantiated for (uint8_t, int8_t, uint16_t, int16_t, uint32_t,
# int32_t, uint64_t, int64_t, float) and fails on anything else ("Unsupported data type",
# dali/operators/generic/erase/erase.cu, ERASE_SUPPORTED_TYPES; the installed libdali_operators.so holds
# EraseImplGpu for exactly those, its CPU twin also for float16, which is why only a GPU saw it). Erasing the
# float32 normalised image keeps torchvision's value=0 exact; erasing the uint8 image before normalising (less
# memory traffic) could only write the mean colour, 0.008 off in normalised units (bench.loaders.ERASE_UINT8).
ERASE_DTYPE = types.FLOAT


def random_erase(images, cfg: AugmentConfig):
    """torchvision's RandomErasing(p=cfg.random_erase, value=0) on normalised ERASE_DTYPE images (CHW or HWC)."""
    anchor, shape = random_erase_box(cfg.image_size, cfg.random_erase)
    return fn.erase(images, anchor=anchor, shape=shape, axis_names="HW", fill_value=0.0)


def torchvision_policy(augment: AugmentConfig):
    """torchvision's transform for augment.auto_augment (nearest-neighbour sampling, fill 0: its defaults)."""
    import torchvision.transforms.v2 as v2

    if augment.auto_augment == "imagenet":
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    if augment.auto_augment == "ra":
        return v2.RandAugment(num_ops=augment.ra_num_ops, magnitude=augment.ra_magnitude)
    return v2.TrivialAugmentWide()
