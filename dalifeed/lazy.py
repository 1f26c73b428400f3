"""Package names imported from their modules on first use, so that importing a package (or any module in it,
which runs its `__init__` first) does not load what its heavier modules need (PIL, numpy, torch, DALI)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_names(package: str, where: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` for `package`, whose name N is `where[N]` (a module relative to the package,
    e.g. ".loader" or "..format") imported when N is first used; once imported, N is a plain attribute. A name
    lent is never also a submodule's name: importing that submodule would bind the module in its place."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name], package), name)
        setattr(sys.modules[package], name, value)  # once: later look-ups do not come here
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
