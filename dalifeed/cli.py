"""`dalifeed`: the commands about dalifeed itself (the data and training ones are shard-convert, dali-train and
dali-bench): `dalifeed doctor`, `dalifeed export`, `dalifeed serve`."""

from __future__ import annotations

import click

from .doctor import doctor
from .export.cli import export
from .export.serve import serve


@click.group()
def main() -> None:
    """dalifeed's own commands: check a node's stack, export a trained run to Triton, serve it. Data and training
    are shard-convert, dali-train and dali-bench (each --help)."""


main.add_command(doctor)
main.add_command(export)
main.add_command(serve)

if __name__ == "__main__":
    main()
