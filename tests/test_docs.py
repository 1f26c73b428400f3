"""The documentation as a reader meets it: README short and usage first, its Python example running on real
shards, no page pointing at a script or data file outside the repository, a reference entry for every name
the packages lend, and no measured figure in the code's comments and docstrings (they live in docs/)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "docker" / "README.md"]
# an absolute path (from / or ~/) to a script or data file (.py .sh .txt .json); example folders such as
# /data/imagenet are fine
ABSOLUTE_FILE = re.compile(r"(?<![\w.:/~-])(?:/|~/)(?:[\w.-]+/)*[\w.-]+\.(?:py|sh|txt|json)\b")
MEASURED = re.compile(r"images/s|this machine| ms |measured", re.IGNORECASE)


def words(path: Path) -> list[str]:
    return path.read_text().split()


def test_readme_is_short_and_starts_with_usage():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1500
    assert len(text[: text.index("make_loader(")].split()) <= 500


def test_benchmarks_page_is_a_reference_not_a_notebook():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.split()) <= 3000
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert not [h for h in headings if re.search(r"issue \d+|20\d\d-\d\d|stop\)", h)], headings


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_file_outside_the_repository(page):
    found = ABSOLUTE_FILE.findall(page.read_text())
    assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_absolute_file_pattern():
    script = ROOT / "examples" / "index_bench_data.py"  # written out absolute, as a page must not
    assert ABSOLUTE_FILE.findall(f"run python {script} first") == [str(script)]
    assert ABSOLUTE_FILE.findall(f"or ~/{script.relative_to(ROOT)}") == [f"~/{script.relative_to(ROOT)}"]
    assert not ABSOLUTE_FILE.findall("shard-convert /data/imagenet out; see docs/format.md and s3://bucket/m.json")


def reference_entries() -> set[str]:
    return {m.group(1) for page in (ROOT / "docs" / "reference").glob("*.md")
            for m in re.finditer(r"^::: ([\w.]+)\s*$", page.read_text(), re.MULTILINE)}


def resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("package", ["dalifeed.pipelines", "dalifeed.convert", "dalifeed.train"])
def test_every_lent_name_has_a_reference_entry(package):
    documented = {id(resolve(entry)) for entry in reference_entries()}
    lent = importlib.import_module(package)
    missing = [name for name in lent.__all__ if id(getattr(lent, name)) not in documented]
    assert not missing, f"{package} lends {missing} without an entry in docs/reference/"


def comment_and_docstring_lines(path: Path) -> dict[int, str]:
    """Line number -> text of every line of `path` inside a comment or a docstring."""
    source = path.read_text()
    lines = source.splitlines()
    found = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        if is_click_command(node):  # its docstring is the command's --help: program output
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            found.update({n: lines[n - 1] for n in range(first.lineno, first.end_lineno + 1)})
    return found


def is_click_command(node) -> bool:
    decorators = [d.func if isinstance(d, ast.Call) else d for d in getattr(node, "decorator_list", [])]
    return any(isinstance(d, ast.Attribute) and d.attr in ("command", "group") for d in decorators)


def test_code_comments_carry_no_measurements():
    hits = [f"{path.relative_to(ROOT)}:{n}: {text.strip()}"
            for path in sorted((ROOT / "dalifeed").rglob("*.py"))
            for n, text in sorted(comment_and_docstring_lines(path).items()) if MEASURED.search(text)]
    assert len(hits) <= 10, "\n".join(hits)


def test_the_readmes_python_example_runs_on_the_demos_data(tmp_path):
    """README's loop, as written, on the demo's digits (its path, epoch count and batch size swapped in)."""
    from dalifeed.convert import ConvertConfig, convert_imagefolder
    from dalifeed.demo import make_digits_imagefolder

    digits = make_digits_imagefolder(tmp_path / "digits", size=32, margin=2)
    convert_imagefolder(ConvertConfig(src=digits, out=tmp_path / "shards", progress=False))
    text = (ROOT / "README.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "make_loader(" in block)
    for old, new in [('"/data/imagenet-shards"', repr(str(tmp_path / "shards"))), ("range(90)", "range(2)"),
                     ("batch_size=256", "batch_size=64")]:
        assert old in example
        example = example.replace(old, new)
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert len(scope["loader"]) == 1438 // 64 and scope["epoch"] == 1  # every batch of two epochs went by
    assert scope["images"].shape == (64, 3, 224, 224) and scope["labels"].dtype == torch.int64


COMMAND_PAGES = sorted((ROOT / "docs" / "commands").glob("*.md"))
RENDER_WITH_CPUS = """
import os, sys
import dalifeed.runtime
n = int(sys.argv[1])
os.cpu_count = lambda: n
os.sched_getaffinity = lambda pid: set(range(n))
dalifeed.runtime.usable_cores = lambda **kwargs: n
sys.path.insert(0, "docs")
import hooks
for page in sys.argv[2:]:
    print(hooks.on_page_markdown(open(page).read(), None, None, None))
"""


def render_command_pages(cpus: int) -> str:
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CPUS_PER_TASK"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", RENDER_WITH_CPUS, str(cpus), *map(str, COMMAND_PAGES)], cwd=ROOT,
                          env=env, check=True, capture_output=True, text=True, timeout=120).stdout


def test_command_pages_state_no_machines_cpu_count():
    """The pages rendered as if on 3 and on 37 CPUs: the same text, each --workers default given as its rule."""
    on_3, on_37 = render_command_pages(3), render_command_pages(37)
    assert on_3 == on_37
    assert "<!-- command-reference" not in on_3 and not re.search(r"(?<!\\)\[default: ", on_3)
    workers = re.findall(r"^#+ `--workers` \{#([\w-]+)\}\n\n(.*)$", on_3, re.MULTILINE)
    stated = [anchor for anchor, facts in workers if "Default:" in facts]
    assert stated == ["workers", "coco-workers", "imagefolder-workers", "tfrecord-workers"], workers
    assert all("the CPUs this process may use" in facts for _, facts in workers if "Default:" in facts)


def test_every_option_has_its_own_anchor():
    text = render_command_pages(2)
    anchors = re.findall(r"^#+ .*\{#([\w-]+)\}$", text, re.MULTILINE)
    assert "tfrecord-image-feature" in anchors and "swa-start" in anchors and "doctor-json" in anchors
    for page in COMMAND_PAGES:  # ids are unique within each page
        ids = re.findall(r"\{#([\w-]+)\}", render_one(page))
        assert len(ids) == len(set(ids)), page.name


def render_one(page: Path) -> str:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks.on_page_markdown(page.read_text(), None, None, None)


def code_strings() -> str:
    """Every string literal in dalifeed/, f-strings' literal parts included, adjacent literals joined."""
    parts = []
    for path in sorted((ROOT / "dalifeed").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts.append(node.value)
    return "\n".join(parts)


def test_troubleshooting_quotes_only_messages_the_code_still_gives():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    quoted = re.findall(r"^### `(.+)`$", text, re.MULTILINE)
    assert len(quoted) >= 30
    strings = code_strings()
    gone = [message for message in quoted if message not in strings]
    assert not gone, f"docs/troubleshooting.md quotes messages dalifeed no longer gives: {gone}"


# The pages a user reads: not the maintainers' (development/) nor the benchmark record.
USER_PAGES = [p for p in sorted((ROOT / "docs").rglob("*.md"))
              if "development" not in p.parts and p.name != "benchmarks.md"]
ABBREVIATIONS = r"(?<!\be\.g\.)(?<!\bi\.e\.)(?<!\betc\.)(?<!\bvs\.)(?<!\bcf\.)"
SENTENCE_END = re.compile(ABBREVIATIONS + r"(?<=[.!?])\s+(?=[A-Za-z`(\[*\"])")
SOURCE_CITATION = re.compile(r"tests/|\btest_\w+|[\w/]+\.(?:py|cc|cpp|h|cu)\b|:\d+\)")


def sentences(markdown: str) -> list[str]:
    """The prose of a page as sentences: code blocks, tables, headings and indented blocks left out."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)
    prose = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("#", "|", "<!--"))
                      and not line.startswith("    "))
    found = []
    for paragraph in re.split(r"\n\s*\n|\n\s*[-*] |\n\s*\d+\. ", prose):
        paragraph = re.sub(r"^\s*(?:[-*]|\d+\.)\s+", "", paragraph)
        found += [s for s in SENTENCE_END.split(" ".join(paragraph.split())) if s.strip()]
    return found


def test_sentences_split_as_a_reader_reads_them():
    assert sentences("One two, e.g. three. Four five.\n\n- Six.\n\n```\nnot. prose.\n```") == [
        "One two, e.g. three.", "Four five.", "Six."]


def test_user_pages_keep_sentences_short():
    """At most 5% of the user pages' sentences run over 45 words."""
    every = [(page, s) for page in USER_PAGES for s in sentences(page.read_text())]
    long = [f"{page.relative_to(ROOT)}: {s[:80]}" for page, s in every if len(s.split()) > 45]
    assert len(long) <= 0.05 * len(every), f"{len(long)} of {len(every)} sentences over 45 words:\n" + "\n".join(long)


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_pages_cite_no_tests(page):
    assert "tests/" not in page.read_text(), f"{page.relative_to(ROOT)} cites tests/: move it to docs/development/"


def test_the_gpu_page_is_the_users():
    text = (ROOT / "docs" / "gpu.md").read_text()
    assert len(text.split()) <= 2500
    assert not SOURCE_CITATION.findall(text)
    assert "pip install -e '.[cuda13]'" in text and "dalifeed doctor" in text
