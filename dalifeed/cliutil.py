"""What the three command lines share: defaults read from their config dataclass, byte sizes, and one-line
errors with the exit codes every dalifeed command uses.

Exit codes: 0 success; 1 a runtime failure (bad data, a full disk, a diverged run), one line on stderr; 2
a usage error (bad option, unusable folder, a folder another run holds), one line; 130 / 143 stopped by
SIGINT / SIGTERM, with where it stopped and how to resume. Tracebacks go to a log file (or the terminal
with --debug), never to the terminal by default.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from .runtime import Stopped, stop_on_signals
from .s3 import is_s3_url

T = TypeVar("T")

_SIZE = re.compile(r"\s*(?P<number>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def default(config_class, name: str):
    """The default of a config dataclass's field, so that a click option states it once, in the dataclass."""
    field = next(f for f in dataclasses.fields(config_class) if f.name == name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def parse_size(text: str) -> int:
    """'512MB' -> 512 * 10**6, '1GiB' -> 2**30, '4096' -> 4096: SI and IEC units as their names say. 'K',
    'M', 'G' alone, and a lower-case 'b' (bits), are refused rather than guessed."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 4096, 512MB, 256MiB, 1GiB)")
    number, unit = float(match["number"]), match["unit"]
    if unit and unit[-1] == "b":
        raise ValueError(f"{text!r}: 'b' is a bit; write {unit[:-1]}B (SI, powers of 1000) or {unit[:-1]}iB "
                         f"(IEC, powers of 1024)")
    if unit.upper() in ("K", "M", "G", "T"):
        raise ValueError(f"{text!r}: write {unit.upper()}B (powers of 1000) or {unit.upper()}iB (powers of 1024)")
    if unit.upper() not in _UNITS:
        raise ValueError(f"{text!r}: unknown unit {unit!r} (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return int(number * _UNITS[unit.upper()])


def size_option(ctx, param, value):
    """A click callback parsing a byte size with `parse_size`."""
    if value is None or isinstance(value, int):
        return value
    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def output_folder_problem(option: str, folder: str | os.PathLike) -> str | None:
    """Why `folder` cannot become a command's output folder (a file is there, or above it; its nearest
    existing folder is not writable), as one line naming `option`; None when nothing is known against it.
    Checked before any work starts, so that a typo costs nothing; creating it can still fail (a read-only
    or virtual file system), which the command reports as well."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        return f"{option} {folder}: is a file, not a folder (choose another {option})"
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{option} {folder}: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{option} {folder}: {existing} is not writable"
    return None


def folder_not_created(option: str, folder: str | os.PathLike, error: OSError) -> str:
    """The one line for an output folder that could not be created."""
    return f"{option} {folder}: cannot create this folder ({error.strerror or error})"


class Location(click.ParamType):
    """A local folder (a Path) or an s3://bucket/prefix URL (kept as text: a Path folds its '//')."""

    name = "path|s3url"

    def convert(self, value, param, ctx):
        return value if isinstance(value, Path) or is_s3_url(value) else Path(value)


LOCATION = Location()


def write_traceback(log: Path | None, error: BaseException) -> Path | None:
    """The full traceback (with any chained cause, e.g. DALI's own error) in `log`, for a bug report."""
    if log is None or not log.parent.is_dir():
        return None
    try:
        log.write_text("".join(traceback.format_exception(error)))
    except OSError:
        return None
    return log


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none: torch.load's errors run
    over several lines (weights_only's advice), as do torch's shape checks (dalifeed/train/models.py)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def error_text(error: BaseException) -> str:
    """The one line an error is shown as: an OSError as "<file>: <what the OS said>" (not "[Errno 13] ...")."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        other = f" -> {error.filename2}" if error.filename2 is not None else ""
        return f"{error.filename}{other}: {error.strerror}"
    return str(error)


def run_command(body: Callable[[], T], *, debug: bool, usage_errors: tuple = (), runtime_errors: tuple = (),
                log: Callable[[], Path | None] = lambda: None, stopped: Callable[[Stopped], str | None] = str,
                prefix: str = "") -> T:
    """Run a command's body under SIGINT/SIGTERM handling, turning exceptions into one line and an exit code
    (see the module docstring). `log()` names the file a traceback goes to; `stopped(e)` says where the
    command stopped and how to resume (None: say nothing, e.g. on ranks other than 0)."""
    with stop_on_signals():
        try:
            return body()
        except Stopped as e:
            message = stopped(e)
            if message:
                click.echo(f"\n{prefix}stopped by {e.name}: {message}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException:
            raise
        except usage_errors as e:
            if debug:
                raise
            raise click.UsageError(f"{prefix}{e}") from None
        except runtime_errors as e:
            if debug:
                raise
            where = write_traceback(log(), e)
            click.echo(f"Error: {prefix}{error_text(e)}" + (f" (traceback: {where})" if where else ""), err=True)
            sys.exit(1)
        except Exception as e:  # a bug: still one line, with the traceback kept for the report
            if debug:
                raise
            where = write_traceback(log(), e)
            click.echo(f"Error: {prefix}unexpected {type(e).__name__}: {e} "
                       f"({f'traceback: {where}; ' if where else ''}rerun with --debug to see it; please report it)",
                       err=True)
            sys.exit(1)
