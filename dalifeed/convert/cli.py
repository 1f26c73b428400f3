"""`shard-convert`: datasets -> WebDataset shards with DALI indexes and a manifest."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import click

from ..atomic import temp_name, write_json_atomic
from ..cliutil import LOCATION, default, run_command, size_option
from ..entry import dali_import_error, exit_without_dali
from ..format import ManifestError, ShardManifest
from ..runtime import DiskFull, FolderInUse
from ..s3 import StorageError, is_s3_url
from ..s3 import list_objects as s3_list_objects
from ..shardfolder import open_shard_folder
from .core import merge, skip_reasons
from .imagefolder import TOP_LEVEL, ConvertConfig, UsageError, convert_imagefolder
from .index import IndexConfig, IndexDataError, IndexUsageError, index_folder
from .info import describe_folder, folder_info
from .jobs import MergeError
from .shards import JOBS_DIR, ConversionFailed, WorkerCrashed
from .verify import verify_shards

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT)
def main() -> None:
    """Turn image datasets into WebDataset tar shards that plain webdataset and NVIDIA DALI read exactly.

    \b
    Typical use:
      shard-convert imagefolder /data/imagenet /data/imagenet-shards --workers 16
      shard-convert verify /data/imagenet-shards --decode
      shard-convert info /data/imagenet-shards
      shard-convert imagefolder /data/imagenet s3://bucket/imagenet-shards   (docs/storage.md)
      shard-convert tfrecord /data/imagenet-tfrecords /data/imagenet-shards   (TensorFlow's files)
      shard-convert index /data/my-webdataset-tars   (adopt tars written elsewhere, in place)

    Each shard `<split>-NNNNNN.tar` has a DALI index `<split>-NNNNNN.idx` beside it and the folder has a
    `manifest.json` (classes, shards with sizes and sha256, skipped files with reasons), written last.
    The format is described in docs/format.md.

    Exit codes: 0 done; 1 a runtime failure (bad data, full disk), one line; 2 a usage error, one line;
    130/143 stopped by Ctrl-C/SIGTERM (run the same command again to resume).
    """


def d(name: str):
    return default(ConvertConfig, name)


def shard_options(command):
    """The options every converter shares (seed, shard size, encoding, workers, errors, jobs, staging)."""
    for option in reversed([
        click.option("--seed", type=int, default=d("seed"), show_default=True,
                     help="Seeds the split and the write-time shuffle. DALI shuffles only inside a buffer, so "
                          "shards are written globally shuffled."),
        click.option("--max-shard-bytes", callback=size_option, default=None,
                     help="Start a new shard before one would exceed this size: 512MB (10^6), 256MiB (2^20), 1GiB. "
                          "Default: 256MiB, unless --samples-per-shard is given alone. Given both, a shard ends at "
                          "whichever it reaches first."),
        click.option("--samples-per-shard", type=int, default=d("samples_per_shard"),
                     help="At most this many samples per shard."),
        click.option("--jpeg-quality", type=int, default=d("jpeg_quality"), show_default=True,
                     help="Quality for images that must be re-encoded: non-JPEG, JPEG encodings that not every decoder "
                          "reads alike (CMYK, YCCK, lossless, arithmetic, 12-bit), EXIF-rotated, or shrunk by "
                          "--max-side. Baseline/progressive 8-bit RGB and greyscale JPEGs pass through byte for byte "
                          "(docs/format.md)."),
        click.option("--max-side", type=int, default=d("max_side"),
                     help="Re-encode images whose long side exceeds N pixels down to N (less decode work later)."),
        click.option("--max-pixels", type=int, default=d("max_pixels"), show_default=True,
                     help="Skip images with more pixels than this (reason 'image larger than --max-pixels'): a "
                          "decompression bomb is refused before it is decoded. Applies only inside the conversion."),
        click.option("--workers", type=int, default=d("workers"), show_default=True,
                     help="Worker processes that decode-check and encode (default: the CPUs this process may use: "
                          "affinity, cgroup quota, SLURM_CPUS_PER_TASK). The output bytes do not depend on it."),
        click.option("--on-error", type=click.Choice(["skip", "fail"]), default=d("on_error"), show_default=True,
                     help="skip: list undecodable, non-image and unreadable files (a broken symlink, a FIFO) in "
                          "the manifest's 'skipped' with the reason; fail: stop at the first one (exit 1)."),
        click.option("--overwrite", is_flag=True, help="Replace an OUT that was made from other input or options."),
        click.option("--staging", type=click.Path(path_type=Path), default=None,
                     help="With an s3://bucket/prefix OUT: the local folder shards are written to and uploaded from; "
                          "each is deleted once it is in the store, so the folder holds a few shards at most. "
                          "Default: a folder in $TMPDIR named after OUT (and the job), removed when done. A "
                          "lease object in the store refuses a second run writing the same OUT (and job) from "
                          "any machine. See docs/storage.md."),
        click.option("--num-jobs", type=int, default=d("num_jobs"), show_default=True,
                     help="Split the conversion into N independent jobs (a Slurm array, a Kubernetes indexed Job): "
                          "each converts its part of the same plan and writes a job record; the last one to finish "
                          "(or `shard-convert merge OUT`) writes manifest.json. OUT may be s3://bucket/prefix "
                          "(give each job its own --staging). See docs/scaling.md."),
        click.option("--job-index", type=int, default=d("job_index"), show_default=True, envvar="DALIFEED_JOB_INDEX",
                     help="Which part this run converts, 0..N-1 (also $DALIFEED_JOB_INDEX; e.g. "
                          "$SLURM_ARRAY_TASK_ID or $JOB_COMPLETION_INDEX)."),
    ]):
        command = option(command)
    return command


@main.command("imagefolder", context_settings=CONTEXT)
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=LOCATION)
@click.option("--val-fraction", type=float, default=d("val_fraction"), show_default=True,
              help="Hold out this fraction of every class as split 'val' (seeded, stratified): of SRC, or with "
                   "split folders, of train/. Not allowed when SRC has a validation folder already.")
@click.option("--top-level", type=click.Choice(TOP_LEVEL), default=d("top_level"), show_default=True,
              help="What the folders at the top of SRC are. auto: splits when all are named like splits (train, "
                   "val, validation, test, ...), classes when none is, refused when both kinds are there. splits: "
                   "the split-named ones are splits, the other folders' files are listed as skipped. classes: "
                   "every folder is a class, whatever its name.")
@shard_options
@click.option("--quiet", is_flag=True, help="No progress bar and no config line: errors alone.")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def imagefolder_cmd(src, out, quiet, debug, **options):
    """Convert an ImageFolder tree SRC to shards in OUT: SRC/<class>/<images> (one split, train), or split
    folders SRC/train/<class>/..., SRC/val/<class>/..., SRC/test/<class>/...

    \b
    Split folders, matched in any case, and the split each becomes:
      train, training                                   -> train
      val, valid, validation, dev, eval, evaluation     -> val   (what dali-train evaluates on)
      test, testing                                     -> test

    The manifest's split_folders records which folder each split came from. Folders of other names beside
    them make SRC ambiguous: it is refused, saying how to choose (--top-level).

    Class order and indices are torchvision ImageFolder's (sorted class folder names; with split folders,
    those of train/). Every file is decoded in full to catch corrupt and truncated images; every entry found
    (a broken symlink, a FIFO too) is either converted or listed as skipped with the reason. Interrupted
    (Ctrl-C, SIGTERM, kill -9)? Run the same command again: finished shards are kept
    and the result is byte-identical to an uninterrupted run. One run at a time per OUT (a lock refuses a
    second one).

    OUT may be s3://bucket/prefix (endpoint and credentials from the standard AWS variables and files):
    each shard is uploaded once finished, manifest.json last; a lease object there refuses a second run
    from any machine; see --staging and docs/storage.md.
    """
    cfg = ConvertConfig(src=src, out=out, progress=not quiet and sys.stderr.isatty(), **options)
    manifest = run_conversion("imagefolder", convert_imagefolder, cfg, debug, quiet)
    exit_if_nothing_converted(manifest)


@main.command("coco", context_settings=CONTEXT)
@click.argument("out", type=LOCATION)
@click.option("--images", "images", multiple=True, required=True, type=click.Path(path_type=Path),
              help="Folder the instances file's file_names are relative to (e.g. coco/train2017). Repeat it, "
                   "once per --annotations, for several splits.")
@click.option("--annotations", "annotations", multiple=True, required=True, type=click.Path(path_type=Path),
              help="A COCO instances file (images, annotations, categories), e.g. "
                   "coco/annotations/instances_train2017.json. Repeatable, paired in order with --images.")
@click.option("--split", "split", multiple=True,
              help="Name of each split, in order. Default: the instances file's name without 'instances_' "
                   "(instances_val2017.json -> val2017).")
@click.option("--skip-empty", is_flag=True,
              help="Leave out images without annotations (listed in the manifest's skipped). Default: keep them "
                   "(detectors learn from background images too).")
@shard_options
@click.option("--quiet", is_flag=True, help="No progress bar and no config line: errors alone.")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def coco_cmd(out, quiet, debug, **options):
    """Convert COCO-format data (images + instances JSON) to shards in OUT, one sample per image record.

    \b
      shard-convert coco /data/coco-shards \\
        --images coco/train2017 --annotations coco/annotations/instances_train2017.json \\
        --images coco/val2017   --annotations coco/annotations/instances_val2017.json

    Each sample holds the image, its record and annotations exactly as given (.json), the training boxes
    (.boxes.f32: float32 x0 y0 x1 y1 relative to the image; crowd ones in .crowdboxes.f32) with contiguous
    labels (.labels.i32: int32; categories sorted by id), and the image id (.id.i64). Nothing is dropped
    silently: missing image files, annotations of unknown images or categories, repeated ids, undecodable
    images and boxes that cannot be training targets are counted and listed in the manifest
    (shard-convert info shows them). `shard-convert export-coco` gives the instances file back.
    docs/coco.md has the details.
    Resumable and deterministic like `imagefolder`; OUT may be s3://bucket/prefix (docs/storage.md).
    """
    from .coco import CocoConfig, convert_coco  # here, not at the top: numpy, which no other command needs

    cfg = CocoConfig(out=out, progress=not quiet and sys.stderr.isatty(), **options)
    manifest = run_conversion("coco", convert_coco, cfg, debug, quiet)
    counts = manifest.extra.get("counts", {})
    if manifest.kind == "coco" and manifest.summary.status in ("fresh", "resume", "merged"):
        click.echo(f"Boxes: {counts.get('boxes', 0)} training targets, {counts.get('crowd_boxes', 0)} crowd, "
                   f"{counts.get('boxes_clipped', 0)} clipped to their image, {counts.get('boxes_dropped', 0)} left "
                   f"out (no area in the image); {counts.get('annotations_not_converted', 0)} annotations not "
                   f"converted (see the manifest's coco.skipped_annotations).")
    exit_if_nothing_converted(manifest)


@main.command("tfrecord", context_settings=CONTEXT)
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=LOCATION)
@click.option("--split", default=None,
              help="Put every file into this split (refused when file names say two splits). Default: the split "
                   "each file's name says: train-* -> train, validation-* (val-*, valid-*) -> val, test-* -> test, "
                   "TensorFlow Datasets' <dataset>-<split>.tfrecord-* -> <split>; files of other names are listed "
                   "as skipped.")
@click.option("--label-offset", type=int, default=None,
              help="Without synsets: added to every label (-1 for ImageNet's 1-based labels, where 0 is background). "
                   "With synsets the labels are the sorted synsets' indices and this, if given, is checked "
                   "against the file's labels (it lets a run whose first classes have no record go on).")
@click.option("--image-feature", default="image/encoded", show_default=True,
              help="The bytes feature holding the image.")
@click.option("--label-feature", default="image/class/label", show_default=True,
              help="The int64 feature holding the class index.")
@click.option("--synset-feature", default="image/class/synset", show_default=True,
              help="The bytes feature naming the class (n01440764). Where records have it, the classes are the "
                   "sorted synsets (torchvision ImageFolder's order); '' to ignore it.")
@click.option("--filename-feature", default="image/filename", show_default=True,
              help="The bytes feature kept in each sample's .json as `filename`, to trace it back.")
@click.option("--synsets-file", type=click.Path(path_type=Path), default=None,
              help="Every synset, one a line (its first word; ImageNet's synsets file or LOC_synset_mapping.txt), "
                   "in class order: the classes, including those no record has, which keep their index.")
@shard_options
@click.option("--quiet", is_flag=True, help="No progress bar and no config line: errors alone.")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def tfrecord_cmd(src, out, quiet, debug, **options):
    """Convert TFRecord files of tf.train.Examples (a file, or a folder of them) to shards in OUT, without
    TensorFlow: ImageNet as TensorFlow's build_imagenet_data.py or the TPU imagenet_to_gcs.py wrote it
    (train-00000-of-01024, validation-00000-of-00128), a TensorFlow Datasets folder
    (<dataset>-train.tfrecord-00000-of-00004 beside dataset_info.json, features.json and label.labels.txt),
    or another layout named by the --*-feature options.

    \b
      shard-convert tfrecord /data/imagenet-tfrecords /data/imagenet-shards --workers 16
      shard-convert tfrecord /data/tensorflow_datasets/my_photos/1.0.0 /data/my-photos-shards

    A TensorFlow Datasets folder is read as TFDS wrote it: each file's split from its name, the image and
    label features and the class names from features.json and <feature>.labels.txt, each file's record
    count checked against dataset_info.json (a difference is a warning in the manifest).

    Every record is framed and both of its CRCs are checked; a corrupt record, one that is not an Example,
    or one without the image is listed in the manifest's skipped with its file and record number (a broken
    length loses the rest of its file, and says so). Gzip- and zlib-compressed files are recognised by their
    bytes and inflated once into $TMPDIR (removed when the run ends; kept only when stopped by a signal,
    for the resume). JPEGs pass through byte for byte under the same rules as `imagefolder`; each sample's
    .json keeps the file, record number and image/filename. Where the file's own labels disagree with the
    sorted synsets' order by more than one constant offset, the conversion stops and names the record (exit
    1); a class with no record is named, and --synsets-file keeps every class's index. Resumable and
    deterministic like `imagefolder`; OUT may be s3://bucket/prefix. docs/format.md#tfrecord-input has the
    details.
    """
    from .tfrecord import TFRecordConfig, convert_tfrecord

    cfg = TFRecordConfig(src=src, out=out, progress=not quiet and sys.stderr.isatty(), **options)
    manifest = run_conversion("tfrecord", convert_tfrecord, cfg, debug, quiet)
    exit_if_nothing_converted(manifest)


@main.command("export-coco", context_settings=CONTEXT)
@click.argument("out", type=LOCATION)
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--split", default=None, help="Which split to export (required when OUT has several).")
def export_coco_cmd(out: Path | str, dest: Path, split: str | None):
    """Rebuild a COCO instances file DEST from the shards in OUT: the same images, annotations (ids, boxes,
    categories, crowd flags, areas, segmentation, extra keys), categories and other top-level keys (info,
    licenses) as the file OUT was made from, less what the conversion listed as skipped.
    pycocotools.coco.COCO(DEST) loads it. OUT may be s3://bucket/prefix (each tar is streamed once)."""
    from .coco import ExportError, export_coco

    def run():
        check_destination(dest)  # before reading every shard
        doc = export_coco(out, split)
        try:
            write_json_atomic(dest, doc)
        except OSError as e:  # name DEST, not the temporary file beside it that the OS names
            raise OSError(e.errno, e.strerror, str(dest)) from e
        return doc

    doc = run_command(run, debug=False, usage_errors=(ExportError, ManifestError),
                      runtime_errors=(StorageError, OSError, DiskFull), stopped=lambda e: "nothing was written")
    click.echo(f"{dest}: {len(doc['images'])} images, {len(doc['annotations'])} annotations, "
               f"{len(doc['categories'])} categories")


def run_conversion(kind: str, convert, cfg, debug: bool, quiet: bool = False) -> ShardManifest:
    """A converter's run as every `shard-convert <kind>` command makes it: its config printed (not with
    --quiet, which leaves errors alone on stderr), errors in one line (the traceback in OUT's
    convert-error.log), the result described. A stop's line adds the notes the converter attached to it."""
    if not quiet:
        click.echo(f"shard-convert {kind}: {json.dumps(cfg.to_json())}", err=True)
    manifest = run_command(
        lambda: convert(cfg), debug=debug, usage_errors=(UsageError, FolderInUse),
        runtime_errors=(ConversionFailed, WorkerCrashed, DiskFull, StorageError, OSError),
        log=lambda: cfg.folder / "convert-error.log",
        stopped=lambda e: "; ".join([f"finished shards in {cfg.location} are kept; run the same command again to "
                                     f"resume", *getattr(e, "__notes__", ())]))
    click.echo(describe_result(manifest))
    return manifest


def exit_if_nothing_converted(manifest: ShardManifest) -> None:
    """A finished conversion without a single sample is bad data, not a success: exit 1 saying why (the
    manifest, kept, lists every skipped file with its reason), on every run of the same command."""
    if manifest.summary.status == "job" or any(info.samples for info in manifest.splits.values()):
        return
    reasons = "; ".join(f"{n} {reason}" for reason, n in skip_reasons(manifest.skipped).items()) or "none found"
    click.echo(f"Error: {manifest.source}: no image could be converted: {len(manifest.skipped)} of {manifest.found} "
               f"skipped ({reasons}); the reasons: shard-convert info {manifest.location}", err=True)
    sys.exit(1)


def check_destination(dest: Path) -> None:
    """DEST must be a file name in an existing folder that takes a new file (it is written atomically, under a
    temporary name beside itself, then renamed)."""
    from .coco import ExportError

    if dest.is_dir():
        raise ExportError(f"{dest}: is a folder; give the instances file to write, e.g. {dest / 'instances.json'}")
    if not dest.parent.is_dir():
        raise ExportError(f"{dest.parent}: {'is not a folder' if dest.parent.exists() else 'no such folder'} "
                          f"(DEST {dest} is written there)")
    probe = temp_name(dest)  # what the atomic write creates first: a folder may refuse it (read-only, /proc)
    try:
        probe.open("wb").close()
    except OSError as e:
        raise ExportError(f"{dest}: cannot write a file in {dest.parent} ({e.strerror or e})") from None
    probe.unlink(missing_ok=True)


def describe_result(manifest: ShardManifest) -> str:
    s = manifest.summary
    if s.status == "done":
        return f"{manifest.location}: already converted with these options; nothing to do ({s.samples} samples)."
    if s.status == "merged":
        return (f"This job wrote its part in {s.seconds:.1f} s and, the last of the jobs to finish, merged them: "
                f"{s.samples} samples in {s.shards} shards, {s.skipped} skipped; manifest: "
                f"{manifest.location}/manifest.json.")
    if s.status == "job":
        return (f"This job wrote {s.samples} samples into {s.shards} shards ({s.bytes / 2**20:.1f} MiB), skipped "
                f"{s.skipped}, in {s.seconds:.1f} s; the other jobs have not all finished: the last one writes "
                f"{manifest.location}/manifest.json (or run: shard-convert merge {manifest.location}).")
    splits = ", ".join(f"{name} {info.samples} in {len(info.shards)} shards" for name, info in manifest.splits.items())
    skipped = "; ".join(f"{n} {r}" for r, n in skip_reasons(manifest.skipped).items()) or "none"
    resumed = " (resumed)" if s.status == "resume" else ""
    warnings = f" {len(manifest.warnings)} warning(s): see shard-convert info." if manifest.warnings else ""
    used = manifest.extra.get("tfrecord", {}) if manifest.kind == "tfrecord" else {}
    features = [used[k] for k in ("image_feature", "label_feature") if k in used]
    read = (f" Features read: {' and '.join(features)} (TensorFlow Datasets' features.json), not those of the config "
            f"line." if features and features != [manifest.options.get(k) for k in ("image_feature", "label_feature")]
            else "")
    found = {"coco": "image records", "tfrecord": "records"}.get(manifest.kind, "files")
    return (f"Converted {s.samples} of {manifest.found} {found} into {s.shards} shards ({splits}), "
            f"{s.bytes / 2**20:.1f} MiB, {len(manifest.classes)} classes, {s.reencoded} re-encoded, "
            f"skipped {s.skipped} ({skipped}), in {s.seconds:.1f} s = {s.images_per_s:.0f} images/s{resumed}. "
            f"Manifest: {manifest.location}/manifest.json; run log: {manifest.location}/convert.json.{read}{warnings}")


@main.command("merge", context_settings=CONTEXT)
@click.argument("out", type=LOCATION)
def merge_cmd(out: Path):
    """Write OUT/manifest.json from the records of the --num-jobs jobs that converted into OUT, after checking
    that every job finished and all ran the same command (but --job-index). The last job to finish does
    this by itself; run it to be sure, or after re-running a failed job. Safe to run again. OUT is a local
    or shared folder, or s3://bucket/prefix (the records are read from the store; the manifest is uploaded
    last, in one PUT)."""
    out = out.rstrip("/") if is_s3_url(out) else out
    manifest = run_command(lambda: merge(out), debug=False, usage_errors=(MergeError, FolderInUse),
                           runtime_errors=(StorageError, OSError), stopped=lambda e: "nothing was written")
    splits = ", ".join(f"{name} {info.samples} in {len(info.shards)} shards" for name, info in manifest.splits.items())
    jobs = count_job_records(manifest)  # the manifest's fingerprint is a single job's
    click.echo(f"{manifest.location}: merged {jobs} jobs into {manifest.location}/manifest.json "
               f"({splits}; {len(manifest.skipped)} skipped).")


def count_job_records(manifest: ShardManifest) -> int:
    if manifest.url:
        return sum(1 for name in s3_list_objects(manifest.url) if name.startswith(f"{JOBS_DIR}/job-"))
    return len(list((manifest.root / JOBS_DIR).glob("job-*-of-*.json")))


@main.command("index", context_settings=CONTEXT)
@click.argument("src", type=LOCATION)
@click.option("--split", default=None,
              help="Every tar is of this split. Default: from each file name's prefix (train-000000.tar -> train, "
                   "validation_00001.tar -> val); tars without one (img2dataset's 00000.tar) are split train.")
@click.option("--label-member", default="cls", show_default=True,
              help="The member holding the label: cls (ASCII integer text, webdataset's convention), json (with "
                   "--label-key), or txt (a class name; give --classes-file for their order).")
@click.option("--label-key", default=None, help="With --label-member json: the key holding the label (an integer "
                                                "class index or a class name).")
@click.option("--classes-file", type=click.Path(path_type=Path), default=None,
              help="Class names, one a line: line i names class i. Default: the integers 0..max for integer "
                   "labels, the names found, sorted, for class names. Refused if integer labels go beyond it.")
@click.option("--max-pixels", type=int, default=IndexConfig.max_pixels, show_default=True,
              help="Leave out images with more pixels than this (read from the JPEG header).")
@click.option("--decode", is_flag=True,
              help="Also decode every image in full (as shard-convert imagefolder does) and leave the ones that do "
                   "not decode (a truncated or corrupt JPEG, which would stop a training run) out of the index, with "
                   "the reason ('image undecodable'). The tars stay unchanged. Slower: the default reads headers.")
@click.option("--workers", type=int, default=None,
              help="Worker processes: each reads one tar at a time (with --decode: the tars are read one at a "
                   "time and these decode their images). Default: the CPUs this process may use. The result does "
                   "not depend on it.")
@click.option("--index-dir", type=click.Path(path_type=Path), default=None,
              help="Write the DALI indexes and manifest.json into this folder (created if missing) instead of beside "
                   "the tars: for tars in a read-only folder. The manifest records where the tars are (their "
                   "absolute folder); dali-train, verify, info, dali-bench and make_loader then take DIR as the "
                   "shard folder. Local SRC only.")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def index_cmd(src: Path, split, label_member, label_key, classes_file, max_pixels, decode, workers, index_dir, debug):
    """Adopt the WebDataset tars in SRC (written by webdataset's ShardWriter, img2dataset or any other tool)
    in place: write a DALI index beside each tar and SRC/manifest.json (or into --index-dir), without
    changing a byte of any tar. SRC may be s3://bucket/prefix (each tar is streamed once; the indexes and
    manifest are written there).

    \b
    Every sample is kept or left out with a reason in the manifest's `skipped` (shard-convert info counts
    them): no image, no label, an image not every decoder reads alike (the header rule of conversion:
    PNG, CMYK, lossless, 12-bit ... JPEGs), with --decode an image that does not decode, a duplicate key,
    a key split across two tars. The index lists the kept samples only, so training never meets the
    others. Then verify, info, dali-train, dali-bench and make_loader work on SRC. See docs/format.md
    ("Shards from elsewhere").

    \b
    Compressed tars (.tar.gz, .tgz, .tar.xz, .txz, .tar.zst, .tzst, .tar.bz2, .tbz2) cannot be read by DALI:
    each is listed in `skipped` with the command that decompresses it beside itself (gunzip -k, xz -dk,
    zstd -d, bunzip2 -k), and index exits 1, after indexing the other tars, or at once when there are no
    others. One with its plain .tar beside it (NAME.tar.gz and NAME.tar) is taken as that tar's copy: noted,
    not counted.
    """
    manifest = run_command(
        lambda: index_folder(IndexConfig(src, split, label_member, label_key, classes_file, max_pixels, decode,
                                         **({"workers": workers} if workers is not None else {}),
                                         index_dir=index_dir)),
        debug=debug, usage_errors=(IndexUsageError,),
        runtime_errors=(IndexDataError, WorkerCrashed, StorageError, OSError),
        stopped=lambda e: "the tars are unchanged; run the same command again")
    click.echo(manifest.summary.describe(manifest))
    compressed = manifest.summary.compressed_error()
    if compressed:  # data left out that one command restores: not a success a script should go on from
        click.echo(f"Error: {manifest.location}: {compressed}", err=True)
        sys.exit(1)


@main.command("verify", context_settings=CONTEXT)
@click.argument("out", type=LOCATION)
@click.option("--decode", is_flag=True,
              help="Also decode every image, with PIL and with DALI's decoder (nvJPEG on a GPU): slower, and finds "
                   "every sample that would stop a training run.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of lines.")
def verify_cmd(out: Path, decode: bool, as_json: bool):
    """Check every shard in OUT against its manifest: tar integrity, sample counts, sha256, index files,
    labels within range, each JPEG's encoding (and with --decode, every image). Prints one line per
    problem and a verdict on stdout (progress on stderr); exit 1 if any problem. OUT may be s3://bucket/prefix
    (every tar is downloaded once, into memory)."""
    if not is_s3_url(out) and not out.is_dir():
        raise click.UsageError(f"{out}: no such shard folder")
    if decode and (error := dali_import_error()) is not None:
        exit_without_dali(error)

    def open_folder():  # once; a store that cannot be reached fails here
        try:
            return open_shard_folder(out)
        except ManifestError:
            return out  # verify_shards reports it as the folder's one problem

    folder = run_command(open_folder, debug=False, runtime_errors=(StorageError, OSError))
    if isinstance(folder, ShardManifest) and folder.tar_root is not None and not as_json:
        click.echo(f"{out}: its manifest reads the tars from {folder.tar_root} (indexed with --index-dir)")
    total = sum(len(s.shards) for s in folder.splits.values()) if isinstance(folder, ShardManifest) else None
    show = sys.stderr.isatty() and not as_json
    from tqdm import tqdm  # here, as in core

    with tqdm(total=total, unit="shard", desc="verify", disable=not show) as bar:
        report = run_command(lambda: verify_shards(folder, decode=decode, on_shard=lambda: bar.update(1)), debug=False,
                             runtime_errors=(StorageError, OSError), stopped=lambda e: "nothing was changed")
    if as_json:
        click.echo(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        for problem in report.problems:
            click.echo(problem)
        verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
        click.echo(f"verify: {report.shards} shards, {report.samples} samples: {verdict}")
    sys.exit(0 if report.ok else 1)


@main.command("info", context_settings=CONTEXT)
@click.argument("out", type=LOCATION)
@click.option("--json", "as_json", is_flag=True, help="Print it as JSON.")
def info_cmd(out: Path | str, as_json: bool):
    """What a shard folder holds, from its manifest (no tar is read): splits, samples, shards and bytes;
    classes with their sample counts per split; re-encoded and skipped files by reason; warnings; the
    options and source it was made from; whether every DALI index file is present. OUT may be
    s3://bucket/prefix (the manifest is fetched, each index checked with a HEAD)."""
    info = run_command(lambda: folder_info(open_shard_folder(out)), debug=False, usage_errors=(ManifestError,),
                       runtime_errors=(StorageError, OSError))
    click.echo(json.dumps(info, indent=2) if as_json else describe_folder(info))


if __name__ == "__main__":
    main()
