"""What a plain dali-train or dali-bench command a user can type gets when it is wrong: one line naming the
bad value, exit 2, before any data is read; never "unexpected ... please report it". Real CLIs on real
shards (the click commands, run as a user's shell runs them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dalifeed.bench.cli import main as bench_cli
from dalifeed.pipelines import AugmentConfig
from dalifeed.train import TrainConfig
from dalifeed.train.cli import main as train_cli
from dalifeed.train.config import ConfigError
from dalifeed.train.models import ModelError, build_model, check_input_size
from fast_recipe import fast_args

FAST = fast_args(epochs=1)  # the training tests' recipe, one epoch


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    """Splits train (45 images) and val (21)."""
    return make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                       samples_per_shard=10)[1]


@pytest.fixture(scope="module")
def train_only(make_shards) -> tuple[Path, Path]:
    """An ImageFolder tree converted without --val-fraction: one split, train. (tree, shards)"""
    return make_shards({"red": 17, "green": 15, "blue": 13}, samples_per_shard=10)


def one_error_line(result) -> str:
    """The single 'Error:' line a failed command printed on stderr; no traceback, no bug-report plea."""
    assert "Traceback" not in result.output and "please report" not in result.output, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    return errors[0]


# ---------------------------------------------------------------------------------------------------------
# splits (issue 18, item 6)


@pytest.mark.parametrize("option, asked", [("--val-split", "validation"), ("--train-split", "training")])
def test_a_split_the_shards_lack_is_a_usage_error_naming_the_splits_they_have(shards, tmp_path, option, asked):
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "run"), *FAST,
                                            option, asked])
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert f"{option} {asked}" in line and "has: train, val" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training


def test_shards_without_a_val_split_need_val_split_none_which_says_there_is_no_evaluation(train_only, tmp_path):
    _, shards = train_only
    default = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "a"), *FAST])
    assert default.exit_code == 2, default.output
    line = one_error_line(default)
    assert "--val-split val" in line and "has: train" in line and "--val-split none" in line

    run = tmp_path / "b"
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(run), *FAST, "--val-split", "none"])
    assert result.exit_code == 0, result.output
    assert "--val-split none: no evaluation" in result.stdout
    record = json.loads((run / "metrics.jsonl").read_text())
    assert "top1" not in record and "val_loss" not in record and record["train_loss"] > 0
    assert json.loads((run / "config.json").read_text())["val_split"] is None


def test_bench_names_the_splits_the_shards_have(train_only, tmp_path):
    tree, shards = train_only
    result = CliRunner().invoke(bench_cli, ["--imagefolder", str(tree), "--shards", str(shards), "--split", "val",
                                            "--out", str(tmp_path / "bench")])
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert "--split val" in line and "has: train" in line


# ---------------------------------------------------------------------------------------------------------
# every other plain command that used to end in "please report it" (issue 18, item 10)


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder")
    return path


TRAIN_ERRORS = [
    # (options after --data SHARDS --out RUN and FAST; {tmp} and {file} filled in), the words the line must hold
    (["--model", "vit_b_16", "--image-size", "60"], ["--model vit_b_16", "--image-size", "divisible by", "16"]),
    (["--model", "alexnet", "--image-size", "32"], ["--model alexnet", "--image-size >= 63", "got 32"]),
    (["--model", "inception_v3", "--image-size", "64"], ["--model inception_v3", "--image-size >= 75"]),
    (["--model", "maxvit_t", "--image-size", "64"], ["--model maxvit_t", "--image-size 64", "224 works"]),
    (["--model", "vgg11", "--width", "16"], ["--width applies to torchvision's plain ResNets"]),
    # BatchNorm in training needs more than one value per channel: ResNet-18's last stage is 1x1 at 32 px
    (["--batch-size", "1", "--image-size", "32"],
     ["--batch-size 1 with --image-size 32", "BatchNorm", "--batch-size >= 2 or --image-size >= 33"]),
    (["--batch-size", "1", "--image-size", "32", "--width", "16"], ["--batch-size 1 with --image-size 32"]),
    (["--out", "{file}"], ["--out {file}", "is a file"]),
    (["--out", "{file}/run"], ["--out {file}/run", "{file} is a file"]),
    (["--out", "/proc/dalifeed-run"], ["--out /proc/dalifeed-run", "cannot create"]),
    (["--data", "{file}"], ["--data {file}", "is a file, not a shard folder"]),
    (["--data", "{tmp}/missing"], ["--data {tmp}/missing", "no such shard folder"]),
    (["--data", "{tmp}"], ["manifest.json: missing"]),
    # classification on COCO shards (the user forgot --task multilabel): DALI's "Underful sample ... please report it"
    (["--data", "{coco}", "--train-split", "mini", "--val-split", "none"],
     ["{coco} holds COCO shards", "--task multilabel"]),
    (["--epochs", "0"], ["--epochs must be >= 1, got 0"]),
    (["--batch-size", "100"], ["--batch-size 100", "the 45 samples of split 'train' each of 1 process"]),
    (["--momentum", "-1", "--optimizer", "sgd"], ["--momentum must be in [0, 1), got -1.0"]),
    (["--weight-decay", "-1"], ["--weight-decay must be >= 0, got -1.0"]),
    (["--min-lr-ratio", "2"], ["--min-lr-ratio must be in [0, 1], got 2.0"]),
    (["--amp", "fp8"], ["--amp", "fp8"]),
    (["--pretrained", "{tmp}/pretrained.json"], ["--pretrained {tmp}/pretrained.json", "unreadable"]),
    (["--progress-every", "-1"], ["--progress-every must be >= 0 seconds, got -1.0"]),
    (["--tensorboard-every", "-5"], ["--tensorboard-every must be >= 0 steps, got -5"]),
]


@pytest.mark.parametrize("extra, words", TRAIN_ERRORS, ids=[" ".join(e) for e, _ in TRAIN_ERRORS])
def test_dali_train_usage_errors_are_one_line_and_exit_2(shards, mini_coco_shards, tmp_path, extra, words):
    fill = {"tmp": str(tmp_path), "file": str(a_file(tmp_path)), "coco": str(mini_coco_shards)}
    (tmp_path / "pretrained.json").write_text('{"not": "weights"}\n')
    data = [] if "--data" in extra else ["--data", str(shards)]  # a repeated --data mixes datasets (issue 23)
    args = [*data, "--out", str(tmp_path / "run"), *FAST, *(a.format(**fill) for a in extra)]
    result = CliRunner().invoke(train_cli, args)
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert all(word.format(**fill) in line for word in words), line


def test_make_loader_refuses_classification_on_coco_shards_in_one_line(mini_coco_shards):
    """Not opened with task="multilabel", COCO shards would reach DALI's reader, which finds no one-class label member
    and fails while building the pipeline ("Underful sample detected ... please report it")."""
    from dalifeed.pipelines import make_loader

    with pytest.raises(ValueError, match=r"holds COCO shards .*open_dataset\(path, task='multilabel'\)"
                                         r".*make_detection_loader"):
        make_loader(mini_coco_shards, "mini", 2, augment=AugmentConfig(image_size=16), device="cpu", num_threads=1)


def test_a_pipeline_that_fails_while_it_is_built_is_one_shard_data_error(mini_coco_shards):
    """DALI 2.4 words a failure during the pipeline's build "Critical error when building pipeline" (not
    "... in pipeline"): the loader turns it into the same one-line ShardDataError. Made here by a loader
    built past make_loader's check, reading COCO shards for a one-class label member they lack."""
    from dalifeed.pipelines.augment import AugmentConfig
    from dalifeed.pipelines.checks import ShardDataError
    from dalifeed.pipelines.dataset import Source
    from dalifeed.pipelines.loader import LoaderOptions, classification_loader
    from dalifeed.shardfolder import open_shard_folder

    options = LoaderOptions("mini", 2, train=False, device="cpu", num_threads=1, prefetch_queue_depth=1,
                            initial_fill=4).resolved()
    loader = classification_loader(Source(str(mini_coco_shards), open_shard_folder(mini_coco_shards)), options,
                                   AugmentConfig(image_size=16))
    with pytest.raises(ShardDataError, match="DALI failed reading split 'mini' .*Underful sample") as info:
        next(iter(loader))
    assert "\n" not in str(info.value) and "Critical error when building pipeline" in str(info.value.__cause__)


def test_a_resume_of_a_folder_that_holds_no_run_is_one_line(tmp_path):
    for run in (tmp_path, a_file(tmp_path)):
        result = CliRunner().invoke(train_cli, ["--resume", str(run)])
        assert result.exit_code == 2, result.output
        assert f"{run}/last.pt: no checkpoint to resume from" in one_error_line(result)


@pytest.mark.parametrize("model, size", [("alexnet", 32), ("vit_b_16", 60), ("maxvit_t", 64)])
def test_a_model_that_cannot_take_the_image_size_is_refused_before_the_run_folder_is_made(shards, tmp_path, model,
                                                                                           size):
    run = tmp_path / "run"
    cfg = TrainConfig(data=str(shards), out=str(run), model=model, image_size=size)
    with pytest.raises(ConfigError, match=f"--model {model}"):
        cfg.validate()
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(run), *FAST, "--model", model,
                                            "--image-size", str(size)])
    assert result.exit_code == 2 and not run.exists(), result.output


@pytest.mark.parametrize("option, label", [
    (["--image-size", "100000"], "--image-size 100000"),
    (["--val-image-size", "100000"], "--val-image-size 100000"),
    (["--val-resize", "100000"], "--val-resize 100000"),
    (["--progressive-resize", "100000:100000"], "--progressive-resize 100000:100000:0:1 (size 100000)"),
])
def test_a_size_no_memory_can_hold_is_refused_before_any_data_is_read(shards, tmp_path, monkeypatch, option, label):
    """A batch of 8 images of 100,000 px a side is at least 240 GB of pixels: a usage error naming the option,
    not DALI's bad_alloc blamed on the shards after they were read (on a process that may use 64 GiB)."""
    import dalifeed.runtime

    monkeypatch.setattr(dalifeed.runtime, "usable_memory", lambda: 64 * 2**30)
    run = tmp_path / "run"
    args = ["--data", str(shards), "--out", str(run), *fast_args(epochs=2, width=8), *option]
    result = CliRunner().invoke(train_cli, args)
    assert result.exit_code == 2 and not run.exists(), result.output
    assert one_error_line(result).startswith(f"Error: {label}: a batch of 8 images of 100000 x 100000 px takes at "
                                             f"least 223.5 GiB (8 x 100000² x 3 bytes), more than the 64.0 GiB of "
                                             f"memory this process may use"), result.output


@pytest.mark.parametrize("model, size, refused", [
    ("vit_b_16", 64, 63), ("vit_b_32", 96, 80), ("maxvit_t", 448, 64), ("googlenet", 32, 14), ("inception_v3", 75, 74),
    ("alexnet", 63, 62), ("resnet18", 8, None)])
def test_models_are_built_for_the_image_size_and_return_logits_in_training(model, size, refused):
    """ViT and MaxViT are built for --image-size (torchvision's builders take it); GoogLeNet and Inception v3
    without their auxiliary heads, whose tuple of outputs no loss takes. Each returns a batch of logits for
    images of that size; `refused` is a size it cannot take."""
    check_input_size(model, size)  # no ModelError
    with torch.device("meta"):  # the shapes, without allocating vit_b_16's 86M weights
        net = build_model(model, 5, image_size=size).train()
        out = net(torch.empty(2, 3, size, size))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5)
    if refused is not None:
        with pytest.raises(ModelError, match=f"--model {model} "):
            check_input_size(model, refused)


@pytest.mark.parametrize("batch_size, size, refused", [(1, 32, True), (1, 33, False), (2, 32, False), (2, 8, False)])
def test_a_batch_of_one_is_refused_only_where_batchnorm_would_see_one_value_per_channel(batch_size, size, refused):
    """The rule behind the refusal: a training BatchNorm needs batch x height x width > 1; ResNet-18's last
    stage is 1x1 from 32 px down and 2x2 at 33 px. Checked against a real forward pass on the CPU."""
    torch.manual_seed(0)
    model = build_model("resnet18", 3, image_size=size).train()
    try:
        model(torch.rand(batch_size, 3, size, size))
        fails = False
    except ValueError as e:
        assert "Expected more than 1 value per channel when training" in str(e)
        fails = True
    assert fails == refused
    if refused:
        with pytest.raises(ModelError, match=f"--batch-size 1 with --image-size {size}: .*BatchNorm"):
            check_input_size("resnet18", size, batch_size=batch_size)
    else:
        check_input_size("resnet18", size, batch_size=batch_size)


def test_vit_b_16_runs_a_64_px_batch_of_the_loader_forward_and_backward(shards, tmp_path):
    """The command of the issue, `--model vit_b_16 --image-size 64`: its config passes, and a real 64 px batch
    of the DALI loader goes through the model dali-train builds, forward and backward (a whole run would
    write two checkpoints of 86M weights and their AdamW state: 2 GB)."""
    from dalifeed.pipelines import make_loader

    TrainConfig(data=str(shards), out=str(tmp_path / "run"), model="vit_b_16", image_size=64).validate()
    images, labels = next(iter(make_loader(shards, "train", 8, augment=AugmentConfig(image_size=64), device="cpu",
                                           num_threads=2, train=True)))
    assert images.shape == (8, 3, 64, 64)
    torch.manual_seed(0)
    model = build_model("vit_b_16", 3, image_size=64).train()
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    assert torch.isfinite(loss) and model.encoder.pos_embedding.grad.shape == (1, (64 // 16) ** 2 + 1, 768)
    assert torch.isfinite(model.encoder.pos_embedding.grad).all()


BENCH_ERRORS = [
    (["--out", "{file}"], ["--out {file}", "is a file"]),
    (["--out", "{file}/bench"], ["--out {file}/bench", "{file} is a file"]),
    (["--model", "resnet9000"], ["--model 'resnet9000'", "not a torchvision classification model"]),
    (["--model", "vit_b_16", "--image-size", "60"], ["--model vit_b_16", "divisible by", "16"]),
    (["--model", "alexnet", "--image-size", "32"], ["--model alexnet", "--image-size >= 63"]),
    (["--model", "resnet18", "--batch-size", "1"],
     ["--batch-size 1 with --image-size 32", "BatchNorm", "--batch-size >= 2 or --image-size >= 33"]),
    (["--epochs", "0"], ["--epochs must be >= 1, got 0"]),
    (["--seconds", "0"], ["--seconds must be > 0, got 0.0"]),
    (["--loaders", ","], ["--loaders: none given"]),
    (["--model", "resnet18", "--model-steps", "0"], ["--model-steps must be >= 1, got 0"]),
    (["--warmup", "-1"], ["--warmup must be >= 0, got -1"]),
    (["--shards", "{coco}", "--split", "mini"], ["--shards {coco} holds COCO shards", "--task detection"]),
]


@pytest.mark.parametrize("extra, words", BENCH_ERRORS, ids=[" ".join(e) for e, _ in BENCH_ERRORS])
def test_dali_bench_usage_errors_are_one_line_and_exit_2(train_only, mini_coco_shards, tmp_path, extra, words):
    tree, shards = train_only
    fill = {"file": str(a_file(tmp_path)), "coco": str(mini_coco_shards)}
    args = ["--imagefolder", str(tree), "--shards", str(shards), "--batch-size", "8", "--image-size", "32",
            "--loaders", "dali-cpu", "--out", str(tmp_path / "bench"), *(a.format(**fill) for a in extra)]
    result = CliRunner().invoke(bench_cli, args)
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert all(word.format(**fill) in line for word in words), line
    assert "images/s" not in result.output  # refused before timing anything
