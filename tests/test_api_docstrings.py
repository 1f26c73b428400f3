"""The Python API as its reference renders it: every name the packages lend (and every other name
docs/reference/ renders) read with griffe and its Google parser, as mkdocstrings reads them. Each has a
docstring; each parameter, constructor argument and dataclass field has a description (an `Args:` or
`Attributes:` line, or a docstring under the field); no docstring sends the reader to a source file instead
of saying the thing, and no `10**9` is left for markdown to turn into bold text."""

from __future__ import annotations

import importlib
import re
from functools import cache
from pathlib import Path

import griffe
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dalifeed.pipelines", "dalifeed.convert", "dalifeed.train")
# what sends a reader elsewhere instead of explaining: "see loader.py", "the module docstring", "X's docstring"
POINTER = re.compile(r"\b[\w/]+\.py\b|module docstring|'s docstring", re.IGNORECASE)
POWER = re.compile(r"\w\*\*\w")  # 10**9 outside backticks renders as "109" with what follows in bold
DESCRIBED_IN = {"parameters", "other parameters", "attributes"}


def reference_entries() -> set[str]:
    return set(listed_members())


def listed_members() -> dict[str, list[str]]:
    """Each entry of docs/reference/ -> the members its `options: members: [...]` renders (none listed: [])."""
    entries = {}
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        for m in re.finditer(r"^::: ([\w.]+)[ \t]*\n((?:[ \t]+\S.*\n)*)", page.read_text() + "\n", re.MULTILINE):
            listed = re.search(r"members:\s*\[([^\]]*)\]", m.group(2))
            entries[m.group(1)] = [name.strip() for name in listed.group(1).split(",")] if listed else []
    return entries


@cache
def package() -> griffe.Module:
    return griffe.load("dalifeed", search_paths=[str(ROOT)], docstring_parser="google")


def griffe_object(path: str) -> griffe.Object:
    obj = package()[path.removeprefix("dalifeed.")]
    return obj.final_target if obj.is_alias else obj


def lent_paths() -> list[str]:
    """Where each name the packages lend (through their lazy `_WHERE` maps) is defined, with the names
    docs/reference/ renders from elsewhere (dalifeed.shardfolder, dalifeed.format); a name re-exported by
    another module counts once."""
    paths = set(reference_entries())
    for package_name in PACKAGES:
        for name, module in importlib.import_module(package_name)._WHERE.items():
            paths.add(f"{importlib.util.resolve_name(module, package_name)}.{name}")
    return sorted({griffe_object(path).path for path in paths})


def described(obj: griffe.Object) -> set[str]:
    """The names an Args/Attributes section of `obj`'s docstring (or its `__init__`'s) gives a description."""
    names = set()
    for holder in (obj, obj.members.get("__init__")):
        if holder is None or holder.is_alias or not holder.docstring:
            continue
        for section in holder.docstring.parsed:
            if section.kind.value in DESCRIBED_IN:
                names |= {item.name.lstrip("*") for item in section.value if item.description.strip()}
    return names


def parameters(obj: griffe.Object) -> list[str]:
    """What a user passes: a function's parameters, a class's constructor arguments (a dataclass's fields)."""
    if obj.is_function:
        function = obj
    elif obj.is_class and "__init__" in obj.members and not obj.members["__init__"].is_alias:
        function = obj.members["__init__"]
    else:
        return []
    return [p.name for p in function.parameters if p.name not in ("self", "cls")]


def undescribed(obj: griffe.Object) -> list[str]:
    have = described(obj)
    missing = []
    for name in parameters(obj):
        field = obj.members.get(name) if obj.is_class else None
        if name in have or (field is not None and not field.is_alias and field.docstring):
            continue
        missing.append(name)
    return missing


def public_members(obj: griffe.Object) -> list[griffe.Object]:
    """The methods and properties the reference renders under a class: its own public ones (mkdocs.yml
    filters out `_` names) and those its entry lists by name (`__iter__`, an inherited `set_epoch`); an
    attribute listed is documented in the class's Attributes section."""
    if not obj.is_class:
        return []
    found = [m for name, m in obj.members.items() if not name.startswith("_") and not m.is_alias
             and (m.is_function or "property" in m.labels)]
    for name in listed_members().get(obj.path, []):
        member = obj.all_members.get(name)
        member = member.final_target if member is not None and member.is_alias else member
        if member is not None and member not in found and (member.is_function or "property" in member.labels):
            found.append(member)
    return found


def problems(path: str) -> list[str]:
    obj = griffe_object(path)
    found = []
    if not obj.docstring:
        found.append("no docstring")
    missing = undescribed(obj)
    if missing:
        found.append(f"no description for {', '.join(missing)}")
    for member in [obj, *public_members(obj)]:
        text = re.sub(r"`[^`]*`", "", member.docstring.value) if member.docstring else ""
        where = "" if member is obj else f"{member.name}: "
        if member is not obj and not member.docstring:
            found.append(f"{where}no docstring")
        if member is not obj and member.is_function and undescribed(member):
            found.append(f"{where}no description for {', '.join(undescribed(member))}")
        found += [f"{where}points at {m.group(0)!r} instead of explaining" for m in POINTER.finditer(text)]
        found += [f"{where}{m.group(0)!r} outside backticks (markdown reads ** as bold)" for m in POWER.finditer(text)]
    return found


@pytest.mark.parametrize("path", lent_paths())
def test_lent_name_is_documented(path):
    found = problems(path)
    assert not found, f"{path}: {'; '.join(found)}"


def test_the_check_sees_what_it_looks_for():
    """The counting itself, on names whose state is known: a field documented under Attributes counts, and
    the lent list holds each package's names and the reference's others."""
    paths = lent_paths()
    assert {"dalifeed.pipelines.factory.make_loader", "dalifeed.train.config.TrainConfig",
            "dalifeed.shardfolder.open_shard_folder", "dalifeed.format.ShardManifest"} <= set(paths)
    config = griffe_object("dalifeed.train.config.TrainConfig")
    assert "epochs" in parameters(config) and "epochs" in described(config)
    assert POINTER.search("the epoch contract: loader.py's docstring") and not POINTER.search("see `resume=`")
