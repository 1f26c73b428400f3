"""How what a user typed is read, and refused in one line: byte sizes ('20GB', '20GiB'), output folders, and
an error shown as one line. Library code and the command lines alike use it (cliutil.py is click's side)."""

from __future__ import annotations

import os
import re
from pathlib import Path

_SIZE = re.compile(r"\s*(?P<number>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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
