"""The demo's runner: the commands it shows run in its process, as the installed console scripts."""

from __future__ import annotations

import sys

import pytest

from dalifeed.demo import Steps


def test_a_command_runs_as_its_console_script_and_a_failure_stops_the_demo_with_its_code(tmp_path, capsys):
    argv = list(sys.argv)
    steps = Steps()
    steps.run("shard-convert", "--help")
    out = capsys.readouterr()
    assert "$ shard-convert --help" in out.err and "imagefolder" in out.out
    with pytest.raises(SystemExit) as stopped:
        steps.run("shard-convert", "verify", str(tmp_path / "missing"))
    assert stopped.value.code == 2 and "missing" in capsys.readouterr().err
    assert sys.argv == argv  # put back after either
