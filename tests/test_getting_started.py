"""docs/getting-started.md as a new user runs it: every bash and python block, in order, in one empty folder,
with the installed console scripts. The training step is the page's, one epoch of a small model."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "getting-started.md"


def blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(bash|python)\n(.*?)^```", PAGE.read_text(), re.DOTALL | re.MULTILINE)


def test_the_page_has_a_block_per_step():
    kinds = [kind for kind, _ in blocks()]
    assert kinds == ["bash", "bash", "python", "bash"]
    assert not [b for _, b in blocks() if "pip install" in b]  # the install is a table: a test cannot run it


@pytest.mark.slow
def test_getting_started_runs_on_the_demos_data(tmp_path):
    env = os.environ | {"PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for kind, code in blocks():
        command = ["bash", "-euo", "pipefail", "-c", code] if kind == "bash" else [sys.executable, "-c", code]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{kind} block failed:\n{code}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        if kind == "python":
            assert done.stdout.split() == ["torch.Size([64,", "3,", "32,", "32])", "torch.float32", "torch.int64"]
    assert "verdict: OK" in subprocess.run(["dalifeed", "doctor"], env=env, capture_output=True, text=True).stdout
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "digits" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [0] and metrics[0]["val_samples"] == 359
    assert {"last.pt", "best.pt", "config.json"} <= {p.name for p in (tmp_path / "runs" / "digits").iterdir()}
