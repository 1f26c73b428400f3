"""`dalifeed doctor`: this node's whole stack for a bug report, and whether it fits (dalifeed/stack.py).

Versions of Python, dalifeed, torch, torchvision and DALI with the CUDA each is built for; the NVIDIA driver and
the newest CUDA it runs; the GPUs NVML, the device files, torch and DALI each see; the CPU (model, cores this
process may use, the SIMD flags torch's and DALI's kernels pick from); the verdict `stack.check` gives, which
is what every command that can use a GPU asks before it starts. `collect` gathers it as a dict (what --json
prints), `render` as text.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

import click

from .runtime import usable_cores
from .stack import DRIVER_FLOOR, INSTALL, StackReport, check, probe

# The flags that decide which kernels torch (ATen's CPU capability), oneDNN and DALI run on x86-64.
SIMD_FLAGS = ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
              "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def collect(report: StackReport | None = None) -> dict:
    """Everything `dalifeed doctor` prints, JSON-ready; `report` is this node's stack check (probed when None)."""
    report = check(probe()) if report is None else report
    return {
        "python": platform.python_version(), "platform": platform.platform(), "executable": sys.executable,
        "dalifeed": _version("dalifeed"), "torchvision": _version("torchvision"),
        "nvidia_ml_py": _version("nvidia-ml-py"), "cpu": cpu_info(), "stack": report.to_json(),
        "verdict": verdict(report), "installs": {f"cuda{major}": {"driver_at_least": DRIVER_FLOOR[major],
                                                                  "command": INSTALL[major]} for major in INSTALL},
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """The CPU's model, its SIMD flags among SIMD_FLAGS, the CPUs of the machine and those this process may use,
    and the kernels torch picked (ATEN_CPU_CAPABILITY can lower them)."""
    first = {}  # the first CPU's lines: every CPU of a machine has the same model and flags
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                first.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    present = set(first.get("flags", "").split())
    model, flags = first.get("model name") or platform.processor() or None, [f for f in SIMD_FLAGS if f in present]
    try:
        import torch

        kernels = torch.backends.cpu.get_cpu_capability()
    except Exception:  # no torch, or one without the call
        kernels = None
    return {"model": model, "machine_cpus": os.cpu_count(), "usable_cores": usable_cores(), "simd_flags": flags,
            "torch_kernels": kernels}


def verdict(report: StackReport) -> str:
    """One sentence: what --device auto does on this node, and why."""
    stack = report.stack
    if report.problems:
        return f"NOT OK: --device auto stops on this node ({len(report.problems)} problem(s) below)"
    if stack.gpu_node:
        driver = (f"driver {stack.driver}, CUDA {stack.driver_cuda}" if stack.driver
                  else "no NVML: driver not read, note below")
        return (f"OK: --device auto runs on the GPU (torch sees {stack.torch_gpus}, DALI sees {stack.dali_gpus}; "
                f"{driver})")
    why = (f"CUDA_VISIBLE_DEVICES={stack.cuda_visible_devices!r} hides the GPUs" if stack.gpus_hidden
           else "this container or job was given no GPU (note below)" if report.notes else "no NVIDIA GPU here")
    return f"OK: {why}; --device auto runs on the CPU"


def render(doc: dict) -> str:
    """`collect`'s dict as the text `dalifeed doctor` prints."""
    s, cpu = doc["stack"], doc["cpu"]
    dali_build = ", ".join(s["dali_packages"]) or "no nvidia-dali-cuda* package"
    if s["dali_cuda_build"]:
        dali_build += f", __cuda_version__ {s['dali_cuda_build']}"
    driver = (f"{s['driver']} (runs CUDA up to {s['driver_cuda']})" if s["driver"] else
              f"not read: NVML does not answer ({s['nvml_error'] or 'no libnvidia-ml.so.1'})" if s["gpu_node"] else
              "none answers (NVML: no libnvidia-ml.so.1)")
    nvml = ", ".join(s["nvml_gpus"]) or (f"not counted ({s['nvml_error']})" if s["driver"] and s["nvml_error"]
                                         else "none")
    hidden = f"; CUDA_VISIBLE_DEVICES={s['cuda_visible_devices']!r}" if s["cuda_visible_devices"] is not None else ""
    lines = [
        "dalifeed doctor: the stack of this node",
        f"  python       {doc['python']} ({doc['executable']}; {doc['platform']})",
        f"  dalifeed     {doc['dalifeed'] or '(not installed: run from a source tree)'}",
        f"  torch        {s['torch'] or 'not installed'} (CUDA {s['torch_cuda'] or 'none: a CPU-only build'}); "
        f"sees {s['torch_gpus']} GPU(s)",
        f"  torchvision  {doc['torchvision'] or 'not installed'}",
        f"  DALI         {s['dali'] or 'not installed'} ({dali_build}); sees {s['dali_gpus']} GPU(s)",
        f"  driver       {driver}",
        f"  GPUs         NVML: {nvml}; device files: "
        f"{', '.join(s['device_files']) or 'none'}{hidden}",
        *([f"{'':15}NVML lists, will not open or name: {', '.join(s['nvml_closed'])}"] if s["nvml_closed"] else []),
        *([f"{'':15}not openable here: {', '.join(s['closed_device_files'])}"] if s["closed_device_files"] else []),
        *([f"{'':15}the host's (/proc): {', '.join(s['host_gpus'])}"] if s["host_gpus"] else []),
        f"  CPU          {cpu['model'] or '?'}; {cpu['usable_cores']} of {cpu['machine_cpus']} CPUs usable; torch "
        f"kernels {cpu['torch_kernels'] or '?'}; {' '.join(cpu['simd_flags']) or 'no SIMD flags read'}",
        f"verdict: {doc['verdict']}",
    ]
    lines += [f"  problem: {p}" for p in s["problems"]]
    lines += [f"  warning: {w}" for w in s["warnings"]]
    lines += [f"  note: {n}" for n in s["notes"]]
    lines.append("installs (from a source checkout; one CUDA major for torch and DALI, chosen by the driver):")
    lines += [f"  {name} (driver >= {i['driver_at_least']}): {i['command']}" for name, i in doc["installs"].items()]
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the check as JSON (for a bug report or a script).")
def doctor(as_json: bool) -> None:
    """Print this node's stack and whether it fits: Python, torch, torchvision and DALI with their CUDA builds,
    the NVIDIA driver and the newest CUDA it runs, the GPUs NVML, torch and DALI see, the CPU, and the verdict
    every dalifeed command that can use a GPU acts on (docs/gpu.md#the-cuda-stack).

    \b
    Example:
      dalifeed doctor            # read it
      dalifeed doctor --json > doctor.json   # attach it to a bug report

    Exit codes: 0 the stack fits this node (or there is no GPU and the CPU runs it); 1 it does not: each
    problem is one line naming what does not fit and the command that fixes it.
    """
    doc = collect()
    click.echo(json.dumps(doc, indent=2) if as_json else render(doc))
    sys.exit(0 if doc["stack"]["ok"] else 1)
