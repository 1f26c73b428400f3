"""`ShardOptions`, the options every converter shares, and where a run writes (OUT, or the staging folder of
an s3:// OUT). The floor of the conversion: `jobs.py` splits a conversion by these options, `remote.py`
uploads from the staging folder they name, `core.py` runs the conversion; none of them is imported here.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..runtime import LOCK_NAME, usable_cores
from ..s3 import StorageError, is_s3_url, parse_s3_url
from .images import DEFAULT_MAX_PIXELS
from .lease import STALE_S
from .shards import JOBS_DIR, PROGRESS_DIR, is_output_file

DEFAULT_MAX_SHARD_BYTES = 256 * 2**20


class UsageError(Exception):
    """Bad input or options: the CLI prints the message in one line and exits 2."""


@dataclass(kw_only=True)
class ShardOptions:
    """The options every converter has: where, how shards are cut and images encoded, how many workers, and
    which of N jobs this run is. `out` stays what the user gave; `folder` is where this run writes."""

    out: Path | str  # OUT as given: a local folder, or s3://bucket/prefix
    seed: int = 0
    max_shard_bytes: int | None = None  # None: 256 MiB, unless samples_per_shard alone is given
    samples_per_shard: int | None = None
    jpeg_quality: int = 95
    max_side: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    workers: int = field(default_factory=usable_cores)  # affinity, cgroup quota, Slurm: not the host's CPUs
    on_error: str = "skip"
    overwrite: bool = False
    progress: bool = True
    num_jobs: int = 1
    job_index: int = 0
    staging: Path | None = None  # --staging: with an s3:// OUT, the local folder shards wait in until uploaded
    lease_stale_s: float = STALE_S  # with an s3:// OUT: another run's lease not renewed for this long is taken over
    remote: str | None = field(init=False)  # OUT's s3:// URL (convert/remote.py uploads to it); None for a local OUT
    # where this run writes shards, records and the manifest: OUT, or the staging folder of an s3:// OUT
    # (--staging, or by default a folder in $TMPDIR named after OUT)
    folder: Path = field(init=False)

    def __post_init__(self) -> None:
        self.staging = Path(self.staging) if self.staging is not None else None
        if is_s3_url(self.out):
            self.out = str(self.out)
            self.remote = self.out.rstrip("/")
            # one staging folder per job: two jobs on one machine must not share (nor wipe) each other's
            self.folder = self.staging or default_staging(
                self.remote + (f"#job-{self.job_index}-of-{self.num_jobs}" if self.jobs else ""))
        else:
            self.out, self.remote = Path(self.out), None
            self.folder = self.out
        # One limit given: that one. Both: a shard ends at whichever it reaches first. Neither: 256 MiB.
        if self.max_shard_bytes is None and self.samples_per_shard is None:
            self.max_shard_bytes = DEFAULT_MAX_SHARD_BYTES

    def validate_shard_options(self) -> None:
        """Check every option up front, naming the bad value."""
        checks = [
            (self.samples_per_shard is None or self.samples_per_shard >= 1,
             f"--samples-per-shard must be >= 1, got {self.samples_per_shard}"),
            (self.max_shard_bytes is None or self.max_shard_bytes >= 4096,
             f"--max-shard-bytes must be >= 4096, got {self.max_shard_bytes}"),
            (1 <= self.jpeg_quality <= 100, f"--jpeg-quality must be in 1..100, got {self.jpeg_quality}"),
            (self.max_side is None or self.max_side >= 8, f"--max-side must be >= 8, got {self.max_side}"),
            (self.max_pixels >= 1, f"--max-pixels must be >= 1, got {self.max_pixels}"),
            (self.workers >= 1, f"--workers must be >= 1, got {self.workers}"),
            (self.on_error in ("skip", "fail"), f"--on-error must be 'skip' or 'fail', got {self.on_error!r}"),
            (self.num_jobs >= 1, f"--num-jobs must be >= 1, got {self.num_jobs}"),
            (0 <= self.job_index < self.num_jobs,
             f"--job-index must be in 0..{self.num_jobs - 1} (--num-jobs {self.num_jobs}), got {self.job_index}"),
            (not (self.overwrite and self.num_jobs > 1),
             "--overwrite with --num-jobs would delete other jobs' shards: empty OUT first instead"),
            (self.staging is None or self.remote is not None, "--staging applies only to an s3://bucket/prefix OUT"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)
        if self.remote is not None:
            try:
                parse_s3_url(self.remote)
            except StorageError as e:
                raise UsageError(str(e)) from None
            stray = [p.name for p in self.folder.iterdir()
                     if not (is_conversion_state(p.name) or is_output_file(p.name))] if self.folder.is_dir() else []
            if stray:
                raise UsageError(f"--staging {self.folder}: holds other files ({stray[0]}); "
                                 f"give an empty or new folder")
        if self.folder.exists() and not self.folder.is_dir():
            raise UsageError(f"{self.folder}: output exists and is not a folder")

    def shard_options(self) -> dict:
        """The options that decide the output bytes (workers, progress and the job index do not)."""
        return {"seed": self.seed, "jpeg_quality": self.jpeg_quality, "max_side": self.max_side,
                "max_pixels": self.max_pixels, "samples_per_shard": self.samples_per_shard,
                "max_shard_bytes": self.max_shard_bytes}

    def to_json(self) -> dict:
        def plain(value):
            if isinstance(value, Path):
                return str(value)
            return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value
        return {k: plain(v) for k, v in asdict(self).items()}

    @property
    def jobs(self) -> bool:
        return self.num_jobs > 1

    @property
    def location(self) -> str:
        """Where the shards go, for messages: OUT, or its s3:// URL."""
        return self.remote or str(self.out)

    @property
    def temporary_staging(self) -> bool:
        """Whether `folder` is the default staging folder of an s3:// OUT, removed when the conversion ends or
        is refused (a --staging folder is kept)."""
        return self.remote is not None and self.staging is None


def default_staging(url: str) -> Path:
    """A staging folder named after the destination, so that a re-run on the same host finds it (and its
    lock refuses a second conversion to the same place)."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"dalifeed-staging-{digest}"


def is_conversion_state(name: str) -> bool:
    """Files a conversion leaves in OUT before it has written anything: state, locks, an error log."""
    return name in (PROGRESS_DIR, JOBS_DIR, LOCK_NAME, "convert-error.log") or name.startswith(".dalifeed-job-")
