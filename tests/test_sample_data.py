"""The demo and bench datasets are built from images shipped in scikit-learn / scikit-image."""

from __future__ import annotations

from collections import Counter

import numpy as np
from PIL import Image

from dalifeed.bench import sample_data
from dalifeed.bench.sample_data import make_digits_imagefolder, make_photos_imagefolder


def test_digits_imagefolder_has_every_digit_once(tmp_path):
    root = make_digits_imagefolder(tmp_path / "digits", size=32, seed=0)
    files = sorted(root.rglob("*.jpg"))
    assert len(files) == 1797
    ids = Counter(f.stem for f in files)
    assert max(ids.values()) == 1  # no image in both train and val
    val = Counter(f.parent.name for f in (root / "val").rglob("*.jpg"))
    train = Counter(f.parent.name for f in (root / "train").rglob("*.jpg"))
    assert sorted(val) == sorted(train) == [str(d) for d in range(10)]
    assert all(abs(val[d] / (val[d] + train[d]) - 0.2) < 0.01 for d in val)
    img = Image.open(files[0])
    assert img.size == (32, 32) and img.mode == "RGB"


def test_photos_are_imagenet_like_jpegs(tmp_path):
    root = make_photos_imagefolder(tmp_path / "photos", per_class=5, seed=0)
    classes = sorted(p.name for p in (root / "train").iterdir())
    assert len(classes) >= 6
    files = sorted(root.rglob("*.jpg"))
    assert len(files) == 5 * len(classes)
    sizes = {Image.open(f).size for f in files}
    assert sizes <= {(500, 375), (375, 500)}
    pixels = np.asarray(Image.open(files[0]), dtype=np.float32)
    assert pixels.std() > 10  # a photograph, not a flat fill
    again = make_photos_imagefolder(tmp_path / "again", per_class=5, seed=0, workers=2)  # in parallel: same files
    assert [f.read_bytes() for f in files] == [(again / f.relative_to(root)).read_bytes() for f in files]
    other = make_photos_imagefolder(tmp_path / "other", per_class=5, seed=1)
    assert (other / files[0].relative_to(root)).read_bytes() != files[0].read_bytes()


def test_digits_are_framed_by_a_black_margin(tmp_path):
    """The 8x8 digits touch their top and bottom rows; framed by 2 black pixels (of 12) each side, no crop of
    the outer eighth cuts a stroke, and the strokes are still there inside."""
    root = make_digits_imagefolder(tmp_path / "digits", size=32, seed=0)
    grey = np.stack([np.asarray(Image.open(f).convert("L")) for f in sorted(root.rglob("*.jpg"))]).astype(int)
    border = np.concatenate([grey[:, :4, :].ravel(), grey[:, -4:, :].ravel(), grey[:, :, :4].ravel(),
                             grey[:, :, -4:].ravel()])
    assert border.max() <= 10  # black, but for JPEG's ringing
    assert (grey[:, 6:26, 6:26].max(axis=(1, 2)) > 200).all()  # every digit has strokes inside the frame
    bare = make_digits_imagefolder(tmp_path / "bare", size=32, seed=0, margin=0)
    assert np.asarray(Image.open(next((bare / "val" / "0").glob("*.jpg"))).convert("L"))[:4].max() > 100


def test_sklearns_files_read_without_it_are_what_its_loaders_give(monkeypatch):
    """The digits and sample photos are read from scikit-learn's files without importing it (2.8 s); they must
    be exactly what load_digits / load_sample_images return, and where the files are not found (a release that
    moves them) the loaders themselves are used."""
    from sklearn.datasets import load_digits, load_sample_images

    assert sample_data.sklearn_file("data", "digits.csv.gz") is not None  # the fast path is the one tested
    images, target = sample_data.sklearn_digits()
    digits = load_digits()
    assert images.dtype == digits.images.dtype and np.array_equal(images, digits.images)
    assert np.array_equal(target, digits.target) and sorted(set(target.tolist())) == list(range(10))
    photos = sample_data.sklearn_sample_images()
    theirs = load_sample_images()
    assert list(photos) == ["china", "flower"]
    assert all(np.array_equal(photos[name], image) for name, image in zip(photos, theirs.images))

    monkeypatch.setattr(sample_data, "sklearn_file", lambda *parts: None)
    images_again, target_again = sample_data.sklearn_digits()
    assert np.array_equal(images_again, images) and np.array_equal(target_again, target)
    assert ({k: v.shape for k, v in sample_data.sklearn_sample_images().items()}
            == {k: v.shape for k, v in photos.items()})
