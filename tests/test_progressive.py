"""Progressive resizing and a validation size of its own: FFCV's schedule (resolution.py), the loader building
each epoch's graph at that epoch's size (also ahead, on `set_epoch` and on a mid-epoch restore), validation at
--val-image-size after --val-resize, dali-train's options, their one-line refusals and --recipe fast-resnet50."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
import torchvision.transforms as T
from click.testing import CliRunner

from dalifeed.pipelines import AugmentConfig, LoaderOptions, make_loader, open_dataset
from dalifeed.pipelines.augment import IMAGENET_MEAN, IMAGENET_STD
from dalifeed.pipelines.resolution import ProgressiveResize
from dalifeed.train import checkpoint
from dalifeed.train.cli import main as train_cli
from test_pipelines import VAL_PHOTO_SHAPES, read_source, real_photo_shards  # noqa: F401 (a fixture)
from test_train import Killed, deterministic, fast_cli_args, metrics

# -- the schedule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, sizes", [
    # FFCV's rn50_88_epochs.yaml (min_res 160, max_res 192, start_ramp 65, end_ramp 76): the line crosses
    # 176 (160 + 16, the rounding point) between epochs 70 (174.5) and 71 (177.5)
    ("160:192:65:76", {e: 160 for e in range(71)} | {e: 192 for e in range(71, 88)}),
    # rn50_16_epochs.yaml: start_ramp 11, end_ramp 13: epoch 12 is 176, a half: to even, 5.5 -> 6, 192
    ("160:192:11:13", {e: 160 for e in range(12)} | {12: 192, 13: 192, 14: 192, 15: 192}),
    # steps of 32 along a longer ramp
    ("128:256:2:6", {0: 128, 1: 128, 2: 128, 3: 160, 4: 192, 5: 224, 6: 256, 7: 256}),
    # halves round to even as numpy's np.round does: 80 / 32 = 2.5 -> 2 (64), 112 / 32 = 3.5 -> 4 (128)
    ("64:128:0:4", {0: 64, 1: 64, 2: 96, 3: 128, 4: 128}),
    # START and END off the 32 grid: the rounded line is kept within [START, END] (FFCV would give 96 at epoch 1)
    ("100:140:0:4", {0: 100, 1: 100, 2: 128, 3: 128, 4: 140, 5: 140}),
    ("96:96:0:3", {e: 96 for e in range(5)}),
])
def test_the_schedule_is_ffcvs(schedule, sizes):
    resize = ProgressiveResize.parse(schedule)
    assert {e: resize.size(e) for e in sizes} == sizes


def test_start_end_ramps_over_the_whole_run_and_describes_itself():
    resize = ProgressiveResize.parse("96:128", epochs=5)
    assert str(resize) == "96:128:0:4"
    assert [resize.size(e) for e in range(5)] == [96, 96, 128, 128, 128]  # 112 at epoch 2: 3.5 -> 4
    assert resize.describe(5) == "epochs 0-1: 96 px, 2-4: 128 px"
    assert ProgressiveResize.parse("160:192:65:76").describe(88) == "epochs 0-70: 160 px, 71-87: 192 px"


@pytest.mark.parametrize("text, message", [
    ("160", "expected START:END or START:END:FROM_EPOCH:TO_EPOCH in whole numbers, such as 160:192:65:76, got '160'"),
    ("160:192:65", "got '160:192:65'"),
    ("160:1.5e2", "got '160:1.5e2'"),
    ("192:160", "192:160: END 160 must be >= START 192 (the size grows)"),
    ("4:64:0:3", "START must be >= 8 px, got 4"),
    ("160:192:9:3", "FROM_EPOCH 9 and TO_EPOCH 3 must satisfy 0 <= FROM_EPOCH <= TO_EPOCH"),
])
def test_a_schedule_that_is_not_one_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        ProgressiveResize.parse(text, epochs=10)


# -- the loader --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(make_shards):
    """test_train's 3 colour-coded classes: 45 train, 21 val images of 24x20 px."""
    _, shards = make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                            samples_per_shard=10)
    return shards


def progressive_loader(shards, schedule: ProgressiveResize):
    data = open_dataset(shards, splits=("train",))
    options = LoaderOptions("train", 4, train=True, seed=5, device="cpu", num_threads=2, checkpointing=True)
    return make_loader(data, **asdict(options), augment=AugmentConfig(image_size=16, crop_scale=(0.5, 1.0)),
                       size_schedule=schedule.size)


@pytest.fixture(scope="module")
def other_shards(make_shards):
    """A second dataset, to mix with `shards`."""
    _, shards = make_shards({"train": {"red": 9, "green": 9}, "val": {"red": 3, "green": 3}}, samples_per_shard=5)
    return shards


SCHEDULE = ProgressiveResize(16, 48, 0, 2)  # epochs 0, 1, 2: 16, 32, 48 px


def test_each_epoch_yields_its_scheduled_size(shards):
    loader = progressive_loader(shards, SCHEDULE)
    for epoch, size in enumerate([16, 32, 48, 48]):  # epochs 1 on: defined ahead while the one before ran
        shapes = {tuple(images.shape) for images, _ in loader}
        assert shapes == {(4, 3, size, size)}, (epoch, shapes)
    loader.set_epoch(1)  # a jump (what a resume at an epoch's start does): that epoch's size
    assert {tuple(images.shape[-2:]) for images, _ in loader} == {(32, 32)}


def test_a_progressive_loader_restored_mid_epoch_continues_at_the_epochs_size(shards):
    straight = progressive_loader(shards, SCHEDULE)
    list(straight)  # epoch 0
    epoch1 = [(images.clone(), labels.clone()) for images, labels in straight]
    assert epoch1[0][0].shape[-1] == 32

    first = progressive_loader(shards, SCHEDULE)
    first.set_epoch(1)
    batches = iter(first)
    for _ in range(2):
        next(batches)
    state = first.state_dict()
    assert state["epoch"] == 1 and state["samples_done"] == 8
    del batches, first

    resumed = progressive_loader(shards, SCHEDULE)  # defined epoch 0's graph (16 px) ahead: not the one restored
    resumed.load_state_dict(state)
    rest = [(images.clone(), labels.clone()) for images, labels in resumed]
    assert len(rest) == len(epoch1) - 2
    for (a_images, a_labels), (b_images, b_labels) in zip(rest, epoch1[2:]):
        assert torch.equal(a_labels, b_labels) and torch.equal(a_images, b_images)  # 32 px, same crops
    assert {tuple(images.shape[-2:]) for images, _ in resumed} == {(48, 48)}  # and epoch 2 at its size


def mixed_progressive_loader(shards, other_shards):
    """45 + 18 samples at 2 + 2 a batch of 4: 15 batches a mixed epoch, in which `other_shards`' loader (9
    batches an epoch of its own) runs two of its epochs: both must be at the mixed epoch's size."""
    data = open_dataset([shards, other_shards], splits=("train",))
    options = LoaderOptions("train", 4, train=True, seed=5, device="cpu", num_threads=2, checkpointing=True)
    return make_loader(data, **asdict(options), augment=AugmentConfig(image_size=16, crop_scale=(0.5, 1.0)),
                       size_schedule=SCHEDULE.size)


def test_a_mixed_loader_yields_each_epochs_size_in_every_part_of_a_batch(shards, other_shards):
    loader = mixed_progressive_loader(shards, other_shards)
    assert loader.reserved == [1, 2]  # what the test is about: a dataset that repeats within an epoch
    for size in (16, 32, 48):
        shapes = [tuple(images.shape) for images, _ in loader]
        assert shapes == [(4, 3, size, size)] * 15


def test_a_mixed_progressive_loader_restored_mid_epoch_continues_at_the_epochs_size(shards, other_shards):
    straight = mixed_progressive_loader(shards, other_shards)
    list(straight)
    epoch1 = [(images.clone(), labels.clone()) for images, labels in straight]

    first = mixed_progressive_loader(shards, other_shards)
    first.set_epoch(1)
    batches = iter(first)
    for _ in range(11):  # past the end of other_shards' first epoch of the two
        next(batches)
    state = first.state_dict()
    del batches, first

    resumed = mixed_progressive_loader(shards, other_shards)
    resumed.load_state_dict(state)
    rest = [(images.clone(), labels.clone()) for images, labels in resumed]
    assert len(rest) == 15 - 11
    for (a_images, a_labels), (b_images, b_labels) in zip(rest, epoch1[11:]):
        assert a_images.shape[-1] == 32 and torch.equal(a_labels, b_labels) and torch.equal(a_images, b_images)


@pytest.mark.kernels
def test_validation_resizes_to_val_resize_then_crops_the_val_size(real_photo_shards):  # noqa: F811
    """torchvision's Resize(48) + CenterCrop(35), not the default Resize(40) (35 / 0.875): the tolerance is
    test_pipelines' (resampling arithmetic), and the default resize is farther than it from these photos."""
    size, resize = 35, 48
    def reference(shorter):
        return T.Compose([T.Resize(shorter), T.CenterCrop(size), T.ToTensor(),
                          T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    source = read_source(real_photo_shards)
    expected = torch.stack([reference(resize)(img) for img, _ in source])
    default = torch.stack([reference(int(size / 0.875))(img) for img, _ in source])

    data = open_dataset(real_photo_shards, splits=("train",))
    loader = make_loader(data, "train", 4, augment=AugmentConfig(image_size=size, val_resize=resize), train=False,
                         device="cpu")
    images = torch.cat([images for images, _ in loader])
    assert images.shape == (len(VAL_PHOTO_SHAPES), 3, size, size)
    assert ((images - expected).abs().flatten(1).mean(1) < 0.01).all()
    assert ((images - default).abs().flatten(1).mean(1) > 0.01).all()


def test_a_val_resize_below_the_crop_is_refused():
    with pytest.raises(ValueError, match="val_resize 30 must be >= image_size 35: the centre crop is taken"):
        AugmentConfig(image_size=35, val_resize=30)


# -- dali-train ----------------------------------------------------------------------------------------------


def test_a_progressive_run_trains_each_epoch_at_its_size_and_evaluates_at_its_own(shards, tmp_path):
    """The sizes the model is given, seen by a global forward hook (torch's): training's per epoch, then
    validation's."""
    seen: list[tuple[bool, int]] = []

    def record(module, args):
        if type(module).__name__ == "ResNet" and args[0].device.type != "meta":  # not the size checks
            seen.append((module.training, args[0].shape[-1]))

    run = tmp_path / "run"
    hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        result = CliRunner().invoke(train_cli, fast_cli_args(shards, epochs=3) + [
            "--progressive-resize", "16:48", "--val-image-size", "40", "--val-resize", "44", "--out", str(run)])
    finally:
        hook.remove()
    assert result.exit_code == 0, result.output
    assert "epochs 0: 16 px, 1: 32 px, 2: 48 px" in result.output
    per_epoch = []
    for training, size in seen:
        if not per_epoch or per_epoch[-1][0] != training:
            per_epoch.append((training, set()))
        per_epoch[-1][1].add(size)
    assert per_epoch == [(True, {16}), (False, {40}), (True, {32}), (False, {40}), (True, {48}), (False, {40})]
    saved = json.loads((run / "config.json").read_text())
    assert (saved["progressive_resize"], saved["val_image_size"], saved["val_resize"]) == ("16:48:0:2", 40, 44)


def test_resume_mid_epoch_of_a_progressive_run_equals_an_uninterrupted_run(shards, tmp_path, monkeypatch):
    args = fast_cli_args(shards, epochs=3) + ["--progressive-resize", "16:48:0:2"]
    straight = tmp_path / "straight"
    assert CliRunner().invoke(train_cli, args + ["--out", str(straight)]).exit_code == 0

    real_save = checkpoint.save

    def save_then_die(path, state):
        real_save(path, state)
        if state.get("midway") and state["state"]["step"] == 7:  # epoch 1 (32 px; 5 steps an epoch), 2 steps in
            raise Killed

    run = tmp_path / "run"
    with monkeypatch.context() as m, pytest.raises(Killed):
        m.setattr(checkpoint, "save", save_then_die)
        CliRunner().invoke(train_cli, args + ["--out", str(run), "--checkpoint-every", "1"])
    saved = torch.load(run / "last.pt", weights_only=False)
    assert saved["state"]["epoch"] == 1 and saved["midway"]["loaders"][0]["samples_done"] == 2 * 8

    resumed = CliRunner().invoke(train_cli, ["--resume", str(run)])
    assert resumed.exit_code == 0, resumed.output
    assert "starting at epoch 1, batch 2 of 5" in resumed.output
    assert deterministic(metrics(run)) == deterministic(metrics(straight))
    a = torch.load(straight / "last.pt", weights_only=False)["model"]
    b = torch.load(run / "last.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("extra, message", [
    (["--progressive-resize", "192:160"], "Invalid value for '--progressive-resize': 192:160: END 160 must be >= "
                                          "START 192 (the size grows)"),
    (["--progressive-resize", "160"], "Invalid value for '--progressive-resize': expected START:END"),
    (["--progressive-resize", "16:64:3:1"], "FROM_EPOCH 3 and TO_EPOCH 1 must satisfy"),
    (["--val-image-size", "32", "--val-resize", "30"],
     "--val-resize 30 must be >= the validation size 32 (--val-image-size, else --image-size)"),
    (["--val-image-size", "4"], "--val-image-size must be >= 8, got 4"),
    (["--model", "vit_b_16", "--image-size", "32", "--progressive-resize", "32:64"],
     "--model vit_b_16 (built for --image-size 32) cannot take --progressive-resize 32:64:0:1's size of epoch 1, "
     "64 px"),
    (["--model", "vit_b_16", "--image-size", "32", "--val-image-size", "48"],
     "--model vit_b_16 (built for --image-size 32) cannot take --val-image-size, 48 px"),
])
def test_bad_sizes_are_one_line_and_exit_2(shards, tmp_path, extra, message):
    result = CliRunner().invoke(train_cli, fast_cli_args(shards, epochs=2) + extra + ["--out", str(tmp_path / "r")])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output and not (tmp_path / "r" / "last.pt").exists()


def test_recipe_fast_resnet50_prints_what_it_sets_and_cannot_do(shards, tmp_path):
    run = tmp_path / "run"
    # typed: the epochs, and sizes a test can afford (the recipe's are 160-192 px, evaluated at 256 after 292)
    result = CliRunner().invoke(train_cli, fast_cli_args(shards, epochs=1, width=8) + [
        "--recipe", "fast-resnet50", "--progressive-resize", "16:32:0:1", "--val-image-size", "24",
        "--val-resize", "28", "--out", str(run)])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("--recipe fast-resnet50:"))
    assert "--label-smoothing 0.1" in line and "--momentum 0.9" in line and "--nesterov False" in line
    assert "not taken over: BlurPool (use_blurpool 1), left-right flip averaging at test time (lr_tta)" in line
    assert "kept: --epochs, --lr, --optimizer, --progressive-resize, --val-image-size, --val-resize, " \
           "--warmup-epochs, --weight-decay" in line
    saved = json.loads((run / "config.json").read_text())
    assert saved["recipe"] == "fast-resnet50" and saved["nesterov"] is False and saved["min_lr_ratio"] == 0.0


def test_recipe_fast_resnet50_is_ffcvs_88_epoch_config():
    """The numbers of libffcv/ffcv-imagenet rn50_configs/rn50_88_epochs.yaml, mapped (config.py says how)."""
    from dalifeed.train.config import RECIPES

    recipe = RECIPES["fast-resnet50"]
    assert recipe["epochs"] == 88 and recipe["progressive_resize"] == "160:192:65:76"
    assert recipe["val_image_size"] == 256 and recipe["val_resize"] == int(256 / (224 / 256))  # 292
    assert recipe["lr"] == pytest.approx(1.7 * 256 / (512 * 8))
    assert (recipe["label_smoothing"], recipe["weight_decay"], recipe["warmup_epochs"]) == (0.1, 1e-4, 2.0)


def test_a_schedule_beyond_the_run_is_warned_about_at_start(shards, tmp_path):
    """A recipe's or a typed schedule that --epochs cuts short (fast-resnet50's 160->192 ramp at epochs 65-76 in
    a 2-epoch run), and a warm-up as long as the run, are said in one line each at start, not scaled."""
    assert ProgressiveResize.parse("160:192:65:76").beyond(88) is None
    assert ProgressiveResize.parse("160:192:65:76").beyond(2) == (
        "its ramp to 192 px (epochs 65-76) ends after the run's last epoch 1: the run trains up to 160 px only")
    assert ProgressiveResize.parse("16:48", epochs=2).beyond(2) is None  # START:END ramps over the run it is given
    result = CliRunner().invoke(train_cli, fast_cli_args(shards, epochs=2, width=8) + [
        "--out", str(tmp_path / "run"), "--progressive-resize", "16:48:1:9", "--warmup-epochs", "2",
        "--val-split", "none"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: --warmup-epochs 2 lasts the whole run (--epochs 2): the learning rate rises to its peak and never "
        "decays",
        "warning: --progressive-resize 16:48:1:9: its ramp to 48 px (epochs 1-9) ends after the run's last epoch 1: "
        "the run trains up to 16 px only (--epochs 2); the schedule is not scaled to the run"], result.output
