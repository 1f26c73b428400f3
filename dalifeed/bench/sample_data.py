"""Small real datasets built from images that ship inside installed packages (nothing is downloaded).

- `make_digits_imagefolder`: scikit-learn's 1,797 handwritten digits (8x8, 17 grey levels), framed by a
  black margin, upscaled and written as RGB JPEG, ImageFolder `train/` + `val/`, classes "0".."9". The
  demo trains on it.
- `make_photos_imagefolder`: ImageNet-like photos (about 500x375, JPEG quality 90) cut from the colour
  sample photos of scikit-image and scikit-learn; one class per source photo. The benchmark reads it.
- `make_photos_coco`: the same photos as COCO-format data (images + instances JSON with random boxes), for
  the COCO conversion and detection benchmarks (docs/coco.md).

Run `python -m dalifeed.bench.sample_data digits OUT` or `... photos OUT --per-class 50`.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import click
import numpy as np
from PIL import Image


def make_digits_imagefolder(out: Path, size: int = 32, seed: int = 0, val_fraction: float = 0.2,
                            margin: int = 2) -> Path:
    """Write the digits as `out/{train,val}/<digit>/<index>.jpg`; a seeded stratified split. Each 8x8 digit
    gets `margin` black pixels on every side before it is upscaled (as MNIST centres its digits in a box):
    the digits touch their top and bottom rows, so without a margin every random crop, and the centre crop
    of validation, cuts off strokes that tell a 9 from an 8 or a 3 from a 5."""
    images, target = sklearn_digits()
    out = Path(out)
    _reset(out)
    rng = np.random.default_rng(seed)
    for label in range(10):
        indices = np.flatnonzero(target == label)
        rng.shuffle(indices)
        n_val = int(round(len(indices) * val_fraction))
        for split, chosen in (("val", indices[:n_val]), ("train", indices[n_val:])):
            folder = out / split / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            for i in sorted(chosen):
                grey = (images[i] * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
                grey = np.pad(grey, margin)
                img = Image.fromarray(grey, "L").resize((size, size), Image.BICUBIC).convert("RGB")
                img.save(folder / f"{i:04d}.jpg", quality=95)
    return out


# scikit-learn's digits and sample photos are read from the files it ships, the way its loaders read them:
# importing scikit-learn (scipy and the rest) is slow, for two files it only reads.
# Where a release moves them, its loaders are used (tests/test_sample_data.py compares both).


def sklearn_file(*parts: str) -> Path | None:
    """A file under the installed scikit-learn's `datasets/` folder, found without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), "datasets", *parts)
    return path if path.is_file() else None


def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """`load_digits()`'s (images (1797, 8, 8) float64 in 0..16, target (1797,) int): its digits.csv.gz, each
    row 64 pixels and the label."""
    path = sklearn_file("data", "digits.csv.gz")
    if path is None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.images, digits.target
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def sklearn_sample_images() -> dict[str, np.ndarray]:
    """`load_sample_images()`'s photos by file stem (china, flower): the JPEGs in its images folder."""
    readme = sklearn_file("images", "README.txt")
    if readme is None:
        from sklearn.datasets import load_sample_images

        images = load_sample_images()
        return {Path(name).stem: image for name, image in zip(images.filenames, images.images)}
    photos = {}
    for path in sorted(readme.parent.glob("*.jpg")):
        with Image.open(path) as image:
            photos[path.stem] = np.asarray(image)
    return photos


def _photo_sources() -> dict[str, np.ndarray]:
    """Colour photographs (H, W, 3 uint8) that ship inside scikit-image and scikit-learn."""
    import skimage.data

    photos = {}
    for name in ("astronaut", "chelsea", "coffee", "rocket", "retina", "motorcycle_left", "hubble_deep_field"):
        loader = getattr(skimage.data, name, None)
        if loader is None:
            continue
        try:
            photo = loader()
        except Exception:  # a photo that would need a download in this skimage version
            continue
        if isinstance(photo, tuple):
            photo = photo[0]
        if photo.ndim == 3 and photo.shape[2] >= 3:
            photos[name] = np.ascontiguousarray(photo[:, :, :3])
    photos.update(sklearn_sample_images())
    return photos


def make_photos_imagefolder(out: Path, per_class: int = 50, seed: int = 0, val_fraction: float = 0.2,
                            quality: int = 90, workers: int = 1) -> Path:
    """Random crops of each photo, resized to 500x375 (or 375x500), lightly colour-jittered, saved as
    JPEG: the size and compression of a typical ImageNet training image. Each class has its own seeded
    generator, so `workers` processes (one class each) write the same files as one."""
    out = Path(out)
    _reset(out)
    n_val = int(round(per_class * val_fraction))
    jobs = [(out, name, photo, per_class, n_val, (seed, index), quality)
            for index, (name, photo) in enumerate(sorted(_photo_sources().items()))]
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
            list(pool.map(_write_photo_class, *zip(*jobs)))
    else:
        for job in jobs:
            _write_photo_class(*job)
    return out


def _write_photo_class(out: Path, name: str, photo: np.ndarray, per_class: int, n_val: int, seed: tuple[int, int],
                       quality: int) -> None:
    rng = np.random.default_rng(seed)
    source = Image.fromarray(photo)
    for i in range(per_class):
        folder = out / ("val" if i < n_val else "train") / name
        folder.mkdir(parents=True, exist_ok=True)
        _random_view(source, rng).save(folder / f"{name}_{i:05d}.jpg", quality=quality)


def _random_view(photo: Image.Image, rng: np.random.Generator) -> Image.Image:
    width, height = photo.size
    target = (500, 375) if rng.random() < 0.75 else (375, 500)
    aspect = target[0] / target[1]
    crop_w = min(width, int(width * rng.uniform(0.5, 1.0)))
    crop_h = min(height, int(crop_w / aspect))
    crop_w = int(crop_h * aspect)
    left = int(rng.integers(0, width - crop_w + 1))
    top = int(rng.integers(0, height - crop_h + 1))
    view = photo.crop((left, top, left + crop_w, top + crop_h)).resize(target, Image.BILINEAR)
    if rng.random() < 0.5:
        view = view.transpose(Image.FLIP_LEFT_RIGHT)
    pixels = np.asarray(view, dtype=np.float32) * rng.uniform(0.8, 1.2, size=3) + rng.uniform(-20, 20)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def _reset(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)


@click.group()
def main() -> None:
    """Build small real ImageFolder datasets from images shipped in scikit-learn / scikit-image."""


@main.command()
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--size", default=32, show_default=True, help="Side of the written square images.")
@click.option("--seed", default=0, show_default=True)
@click.option("--margin", default=2, show_default=True, help="Black pixels around each 8x8 digit before upscaling.")
def digits(out: Path, size: int, seed: int, margin: int) -> None:
    """scikit-learn's handwritten digits as OUT/{train,val}/<digit>/*.jpg."""
    make_digits_imagefolder(out, size=size, seed=seed, margin=margin)
    click.echo(f"wrote digits ImageFolder to {out}")


@main.command()
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--per-class", default=50, show_default=True, help="Images per class (one class per photo).")
@click.option("--seed", default=0, show_default=True)
def photos(out: Path, per_class: int, seed: int) -> None:
    """ImageNet-like 500x375 JPEG q90 photos as OUT/{train,val}/<photo>/*.jpg."""
    make_photos_imagefolder(out, per_class=per_class, seed=seed)
    click.echo(f"wrote photos ImageFolder to {out}")


if __name__ == "__main__":
    main()


def make_photos_coco(out: Path, per_class: int = 50, seed: int = 0) -> tuple[Path, Path]:
    """COCO-format data from the photo set: `out/images/*.jpg` (500x375 photos) and `out/instances_photos.json`
    with 0-6 seeded random boxes per image over 12 categories with sparse ids (COCO's are 1..90 with gaps),
    some crowd. The boxes mean nothing; they exercise conversion, the detection graph and the benchmarks."""
    out = Path(out)
    photos = make_photos_imagefolder(out / "tree", per_class=per_class, seed=seed, val_fraction=0.0)
    rng = np.random.default_rng(seed)
    images_dir = out / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    category_ids = [1, 2, 3, 5, 8, 13, 21, 34, 55, 67, 89, 90]
    images, annotations = [], []
    for image_id, path in enumerate(sorted(p for p in photos.rglob("*.jpg")), start=1):
        name = f"{image_id:012d}.jpg"
        target = images_dir / name
        if not target.exists():
            path.replace(target)
        with Image.open(target) as img:
            width, height = img.size
        images.append({"id": image_id, "file_name": name, "width": width, "height": height})
        for _ in range(int(rng.integers(0, 7))):
            w, h = rng.uniform(0.05, 0.6) * width, rng.uniform(0.05, 0.6) * height
            x, y = rng.uniform(0, width - w), rng.uniform(0, height - h)
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": int(rng.choice(category_ids)),
                                "bbox": [round(x, 2), round(y, 2), round(w, 2), round(h, 2)], "area": round(w * h, 2),
                                "iscrowd": int(rng.random() < 0.05),
                                "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]})
    shutil.rmtree(out / "tree")
    doc = {"images": images, "annotations": annotations,
           "categories": [{"id": c, "name": f"category-{c}", "supercategory": "thing"} for c in category_ids]}
    instances = out / "instances_photos.json"
    instances.write_text(json.dumps(doc))
    return images_dir, instances
