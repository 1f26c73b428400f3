"""`dalifeed`: the commands about dalifeed itself (the data and training ones are shard-convert, dali-train and
dali-bench). One so far: `dalifeed doctor`."""

from __future__ import annotations

import click

from .doctor import doctor


@click.group()
def main() -> None:
    """dalifeed's own commands. The work is done by shard-convert, dali-train and dali-bench (each --help)."""


main.add_command(doctor)

if __name__ == "__main__":
    main()
