"""What the three command lines share on click's side: defaults read from their config dataclass, byte-size
options (usage.parse_size), and one-line errors with the exit codes every dalifeed command uses.

Exit codes: 0 success; 1 a runtime failure (bad data, a full disk, a diverged run), one line on stderr; 2
a usage error (bad option, unusable folder, a folder another run holds), one line; 130 / 143 stopped by
SIGINT / SIGTERM, with where it stopped and how to resume. Tracebacks go to a log file (or the terminal
with --debug), never to the terminal by default.
"""

from __future__ import annotations

import dataclasses
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import click

from .runtime import Stopped, stop_on_signals
from .s3 import is_s3_url
from .usage import error_text, parse_size

T = TypeVar("T")




def default(config_class, name: str):
    """The default of a config dataclass's field, so that a click option states it once, in the dataclass."""
    field = next(f for f in dataclasses.fields(config_class) if f.name == name)
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def size_option(ctx, param, value):
    """A click callback parsing a byte size with `parse_size`."""
    if value is None or isinstance(value, int):
        return value
    try:
        return parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


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
