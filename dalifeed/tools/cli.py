"""`shard-convert`: datasets -> WebDataset shards with DALI indexes and a manifest."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import click
from tqdm import tqdm

from .images import DEFAULT_MAX_PIXELS
from .imagefolder import DEFAULT_MAX_SHARD_BYTES, ConvertConfig, UsageError, convert_imagefolder
from ..format import ShardManifest
from .shards import ConversionFailed, WorkerCrashed
from .verify import verify_shards


def _size(text: str) -> int:
    """'256MB', '1GiB', '4096' -> bytes."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    number, unit = (t[:-1], t[-1]) if t and t[-1] in units else (t, "")
    try:
        return int(float(number) * units[unit])
    except ValueError:
        raise click.BadParameter(f"not a size: {text!r} (e.g. 256MB, 1GB, 100000)") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
def main() -> None:
    """Turn image datasets into WebDataset tar shards that plain webdataset and NVIDIA DALI read exactly.

    \b
    Typical use:
      shard-convert imagefolder /data/imagenet /data/imagenet-shards --workers 16
      shard-convert verify /data/imagenet-shards --decode

    Each shard `<split>-NNNNNN.tar` has a DALI index `<split>-NNNNNN.idx` beside it and the folder has a
    `manifest.json` (classes, shards with sizes and sha256, skipped files with reasons), written last.
    The format is described in docs/format.md.
    """


@main.command("imagefolder", context_settings={"max_content_width": 100})
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--val-fraction", type=float, default=0.0, show_default=True,
              help="Hold out this fraction of every class as split 'val' (seeded, stratified). "
                   "Not allowed when SRC already has train/ and val/.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seeds the split and the write-time shuffle. DALI shuffles only inside a buffer, so "
                   "shards are written globally shuffled.")
@click.option("--max-shard-bytes", type=str, default=f"{DEFAULT_MAX_SHARD_BYTES // 2**20}MiB", show_default=True,
              help="Start a new shard before one would exceed this size (e.g. 512MB, 1GiB).")
@click.option("--samples-per-shard", type=int, default=None,
              help="Fixed number of samples per shard instead of --max-shard-bytes.")
@click.option("--jpeg-quality", type=int, default=95, show_default=True,
              help="Quality for images that must be re-encoded: non-JPEG, JPEG encodings that not every decoder "
                   "reads alike (CMYK, YCCK, lossless, arithmetic, 12-bit), EXIF-rotated, or shrunk by --max-side. "
                   "Baseline/progressive 8-bit RGB and greyscale JPEGs pass through byte for byte (docs/format.md).")
@click.option("--max-side", type=int, default=None,
              help="Re-encode images whose long side exceeds N pixels down to N (less decode work later).")
@click.option("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, show_default=True,
              help="Skip images with more pixels than this (reason 'image larger than --max-pixels'): a "
                   "decompression bomb is refused before it is decoded. Applies only inside the conversion.")
@click.option("--workers", type=int, default=os.cpu_count() or 1, show_default=True,
              help="Worker processes that decode-check and encode. The output bytes do not depend on it.")
@click.option("--on-error", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
              help="skip: list undecodable or non-image files in the manifest's 'skipped' with the reason; "
                   "fail: stop at the first one (exit 1).")
@click.option("--overwrite", is_flag=True, help="Replace an OUT that was made from other input or options.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def imagefolder_cmd(src, out, val_fraction, seed, max_shard_bytes, samples_per_shard, jpeg_quality, max_side,
                    max_pixels, workers, on_error, overwrite, quiet):
    """Convert an ImageFolder tree SRC (SRC/<class>/<images>, or SRC/train/<class>/... and SRC/val/<class>/...)
    to shards in OUT.

    Class order and indices are torchvision ImageFolder's (sorted class folder names). Every file is
    decoded in full to catch corrupt and truncated images; every file found is either converted or listed
    as skipped. Interrupted? Run the same command again: finished shards are kept and the result is
    byte-identical to an uninterrupted run.
    """
    cfg = ConvertConfig(src=src, out=out, val_fraction=val_fraction, seed=seed,
                        max_shard_bytes=_size(max_shard_bytes), samples_per_shard=samples_per_shard,
                        jpeg_quality=jpeg_quality, max_side=max_side, max_pixels=max_pixels, workers=workers,
                        on_error=on_error, overwrite=overwrite, progress=not quiet and sys.stderr.isatty())
    click.echo(f"shard-convert imagefolder: {json.dumps(cfg.to_json())}", err=True)
    try:
        manifest = convert_imagefolder(cfg)
    except UsageError as e:
        raise click.UsageError(str(e)) from None
    except (ConversionFailed, WorkerCrashed) as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("\ninterrupted: finished shards are kept; run the same command again to resume", err=True)
        sys.exit(130)
    click.echo(describe_result(manifest))


def describe_result(manifest: ShardManifest) -> str:
    s = manifest.summary
    if s.status == "done":
        return f"{manifest.root}: already converted with these options; nothing to do ({s.samples} samples)."
    splits = ", ".join(f"{name} {info.samples} in {len(info.shards)} shards" for name, info in manifest.splits.items())
    reasons = {}
    for entry in manifest.skipped:
        reason = entry["reason"].split(":")[0]
        reasons[reason] = reasons.get(reason, 0) + 1
    skipped = "; ".join(f"{n} {r}" for r, n in sorted(reasons.items())) or "none"
    resumed = " (resumed)" if s.status == "resume" else ""
    return (f"Converted {s.samples} of {manifest.found} files into {s.shards} shards ({splits}), "
            f"{s.bytes / 2**20:.1f} MiB, {len(manifest.classes)} classes, {s.reencoded} re-encoded, "
            f"skipped {s.skipped} ({skipped}), in {s.seconds:.1f} s = {s.images_per_s:.0f} images/s{resumed}. "
            f"Manifest: {manifest.root / 'manifest.json'}; run log: {manifest.root / 'convert.json'}.")


@main.command("verify")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--decode", is_flag=True, help="Also decode every image (slower; catches corrupt JPEG data).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of lines.")
def verify_cmd(out: Path, decode: bool, as_json: bool):
    """Check every shard in OUT against its manifest: tar integrity, sample counts, sha256, index files,
    labels within range (and with --decode, every image). Prints one line per problem; exit 1 if any."""
    if not out.is_dir():
        raise click.UsageError(f"{out}: no such shard folder")
    try:
        total = sum(len(s.shards) for s in ShardManifest.load(out).splits.values())
    except Exception:
        total = None
    show = sys.stderr.isatty() and not as_json
    with tqdm(total=total, unit="shard", desc="verify", disable=not show) as bar:
        report = verify_shards(out, decode=decode, on_shard=lambda: bar.update(1))
    if as_json:
        click.echo(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        for problem in report.problems:
            click.echo(problem)
        verdict = "OK" if report.ok else f"{len(report.problems)} problem(s)"
        click.echo(f"verify: {report.shards} shards, {report.samples} samples: {verdict}", err=True)
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
