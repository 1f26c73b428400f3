"""The command pages, written from the click commands themselves when the site is built (an mkdocs hook).

A page holds a line `<!-- command-reference MODULE:OBJECT PROG [SUBCOMMAND] -->`; the hook replaces it with a
section per command: its help, its usage, then one heading per option (an anchor to link to) with the option's
type, default and help. A default that depends on the machine is printed as its rule (`MACHINE_DEFAULTS`),
never as the number the build machine computed."""

from __future__ import annotations

import html
import importlib
import inspect
import re

import click

MARKER = re.compile(r"^<!-- command-reference (\S+):(\S+) (\S+)(?: (\S+))? -->$", re.MULTILINE)

# Options whose default is computed from the machine that imports the command: the rule, in the user's words.
MACHINE_DEFAULTS = {
    "workers": "the CPUs this process may use (its CPU affinity, cgroup CPU quota and Slurm's CPUs per task)",
}
TYPE_NAMES = {"integer": "integer", "float": "number", "text": "text", "boolean": "flag", "path": "path",
              "path|s3url": "path or `s3://bucket/prefix`"}


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: command_reference(*m.groups()), markdown)


def command_reference(module: str, attr: str, prog: str, only: str | None = None) -> str:
    """Markdown for the click command `module.attr` run as `prog`: the group and each subcommand (or only `only`)."""
    command = getattr(importlib.import_module(module), attr)
    if not isinstance(command, click.Group):
        return command_section(command, prog, prefix="", level=2)
    names = [only] if only else sorted(command.commands)
    parts = [] if only else [text_blocks(command.help or "")]
    for name in names:
        parts.append(command_section(command.commands[name], f"{prog} {name}", prefix=f"{name}-", level=2))
    return "\n\n".join(parts)


def command_section(command: click.Command, prog: str, prefix: str, level: int) -> str:
    ctx = click.Context(command, info_name=prog)
    usage = " ".join(command.collect_usage_pieces(ctx))
    head = "#" * level
    lines = [f"{head} {prog} {{#{prefix.rstrip('-') or 'usage'}}}" if prefix else "", "",
             "```text", f"{prog} {usage}", "```", "", text_blocks(command.help or ""), ""]
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    if arguments:
        lines += ["Arguments: " + ", ".join(f"`{a.human_readable_name}` ({type_name(a)})" for a in arguments), ""]
    for option in (p for p in command.params if isinstance(p, click.Option) and not p.hidden):
        lines += option_entry(option, prefix, level + 1)
    return "\n".join(lines).strip("\n")


def option_entry(option: click.Option, prefix: str, level: int) -> list[str]:
    names = ", ".join(f"`{n}`" for n in option.opts)
    if option.secondary_opts:  # --compile / --no-compile: the off switch
        names += " / " + ", ".join(f"`{n}`" for n in option.secondary_opts)
    facts = [f"**Type:** {type_name(option)}"]
    default = default_text(option)
    if default is not None:
        facts.append(f"**Default:** {default}")
    envvar = option.envvar if isinstance(option.envvar, str) else None
    if envvar:
        facts.append(f"**Environment:** `{envvar}`")
    anchor = next((n for n in option.opts if n.startswith("--")), option.opts[0]).lstrip("-")
    return [f"{'#' * level} {names} {{#{prefix}{anchor}}}", "", " · ".join(facts), "",
            text_blocks(option.help or ""), ""]


def type_name(param: click.Parameter) -> str:
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    if isinstance(param.type, click.Choice):
        return "one of " + ", ".join(f"`{c}`" for c in param.type.choices)
    return TYPE_NAMES.get(param.type.name, f"`{param.type.name}`")


def default_text(option: click.Option) -> str | None:
    """The default as the page states it, or None where the option has none worth stating."""
    if option.name in MACHINE_DEFAULTS and option.default is not None:
        return MACHINE_DEFAULTS[option.name]
    if isinstance(option.show_default, str):
        return escape(option.show_default)
    if option.is_flag and not option.secondary_opts:
        return None
    if not option.show_default or option.default is None or callable(option.default):
        return None
    value = option.default
    if option.is_flag:
        value = option.opts[0] if value else option.secondary_opts[0]
    elif isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return f"`{value}`"


def text_blocks(text: str) -> str:
    """Click help text as Markdown: its paragraphs, and the paragraphs click keeps unwrapped (`\\b`) as code."""
    text = inspect.cleandoc(text.split("\f")[0])
    blocks = []
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.startswith("\b"):
            body = inspect.cleandoc(paragraph[1:].lstrip("\n"))
            blocks.append(f"```text\n{body}\n```")
        elif paragraph.strip():
            blocks.append(link_pages(escape(" ".join(line.strip() for line in paragraph.splitlines()))))
    return "\n\n".join(blocks)


def link_pages(text: str) -> str:
    """`docs/storage.md` in a command's help, a link to that page (the command pages are one folder down)."""
    return re.sub(r"(?<![\w/`])docs/([\w/-]+\.md(?:#[\w-]+)?)", r"[\g<0>](../\1)", text)


def escape(text: str) -> str:
    """Text outside backticks with Markdown's and HTML's active characters made literal."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if part.startswith("`") else re.sub(r"([*_\[\]\\])", r"\\\1", html.escape(part, quote=False))
                   for part in parts)
