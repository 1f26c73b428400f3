"""The CUDA stack (dalifeed/stack.py): the decision for version combinations a user's node can have, given by
hand; the probe and `--device auto` on this machine (no NVIDIA driver) for real; the declared installs and the
pip reports measured for them; `dalifeed doctor`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

from dalifeed.cli import main as dalifeed_cli
from dalifeed.pipelines import resolve_device
from dalifeed.stack import (
    INSTALL,
    Stack,
    StackMismatch,
    check,
    choose_device,
    dali_distributions,
    host_gpu_entries,
    install_majors,
    installed_packages,
    nvidia_device_files,
    pip_report_packages,
    probe,
    torch_build_major,
)
from dalifeed.train.distributed import setup

ROOT = Path(__file__).resolve().parents[1]
REPORTS = Path(__file__).parent / "data" / "pip-reports"
EIGHT = ("NVIDIA H100 80GB HBM3",) * 8
R535 = dict(driver="535.104.05", driver_cuda="12.2", nvml_gpus=EIGHT)
R580 = dict(driver="580.65.06", driver_cuda="13.0", nvml_gpus=EIGHT)
TORCH_CU130 = dict(torch="2.14.1+cu130", torch_cuda="13.0")
TORCH_CU126 = dict(torch="2.14.1+cu126", torch_cuda="12.6")
DALI_120 = dict(dali="2.4.0", dali_packages=("nvidia-dali-cuda120",))
DALI_130 = dict(dali="2.4.0", dali_packages=("nvidia-dali-cuda130",))
SEES_8 = dict(torch_gpus=8, dali_gpus=8)


# -- the decision, for the stacks a node can have -----------------------------------------------------------

def test_r535_with_pypis_cu130_torch_is_refused_in_one_line_with_the_fix():
    """The issue's case: PyPI's torch (CUDA 13.0) on a CUDA 12 driver; torch.cuda.is_available() is False there,
    and 'auto' used to train on the CPU."""
    report = check(Stack(**R535, **TORCH_CU130, **DALI_120))
    assert report.problems == [
        "driver 535.104.05 runs CUDA up to 12.2 but torch 2.14.1+cu130 is built for CUDA 13.0 (needs driver >= "
        "580.65.06): pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cu126"
        " (or upgrade the driver)"]
    for device in ("auto", "gpu", "hybrid"):
        with pytest.raises(StackMismatch, match=r"^driver 535\.104\.05 runs CUDA up to 12\.2 but torch .*/whl/cu126"):
            choose_device(device, report)
    assert choose_device("cpu", report) == "cpu"  # asked for by name: taken as asked
    assert report.device == "refused"


def test_r535_with_a_whole_cuda13_stack_names_both_fixes_and_says_there_are_more():
    report = check(Stack(**R535, **TORCH_CU130, **DALI_130))
    assert len(report.problems) == 2 and "torch 2.14.1+cu130 is built for CUDA 13.0" in report.problems[0]
    assert report.problems[1] == (
        "driver 535.104.05 runs CUDA up to 12.2 but DALI 2.4.0 (nvidia-dali-cuda130) is built for CUDA 13 (needs "
        "driver >= 580.65.06): pip uninstall -y nvidia-dali-cuda130 && pip install 'nvidia-dali-cuda120>=2.0' "
        "(or upgrade the driver)")
    assert report.one_line().endswith("(or upgrade the driver) (and 1 more: run `dalifeed doctor`)")


def test_r580_with_cu120_dali_beside_cu130_torch_installs_dali_for_cuda_13():
    """Both run on R580, as two CUDA runtimes in one process: not one stack."""
    report = check(Stack(**R580, **TORCH_CU130, **DALI_120, **SEES_8))
    assert report.problems == [
        "torch 2.14.1+cu130 is built for CUDA 13.0 but DALI 2.4.0 (nvidia-dali-cuda120) for CUDA 12: install DALI "
        "for CUDA 13: pip uninstall -y nvidia-dali-cuda120 && pip install 'nvidia-dali-cuda130>=2.0'"]


def test_r580_with_cu126_torch_and_cu130_dali_matches_dali_to_torch():
    report = check(Stack(**R580, **TORCH_CU126, **DALI_130, **SEES_8))
    assert report.problems[0].endswith(
        "install DALI for CUDA 12: pip uninstall -y nvidia-dali-cuda130 && pip install 'nvidia-dali-cuda120>=2.0'")


def test_a_cpu_only_torch_on_a_gpu_node_gets_the_build_for_the_driver():
    report = check(Stack(**R580, torch="2.14.1+cpu", torch_cuda=None, **DALI_130, dali_gpus=8))
    assert report.problems == [
        "torch 2.14.1+cpu is a CPU-only build (torch.version.cuda is None) on a node with 8 NVIDIA GPU(s): pip "
        "install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cu130"]


@pytest.mark.parametrize("driver, torch, dali", [(R535, TORCH_CU126, DALI_120), (R580, TORCH_CU130, DALI_130),
                                                 (R580, TORCH_CU126, DALI_120)],  # a CUDA 12 stack on R580: fine
                         ids=["r535-cuda12", "r580-cuda13", "r580-cuda12"])
def test_a_stack_of_one_major_the_driver_runs_uses_the_gpus(driver, torch, dali):
    report = check(Stack(**driver, **torch, **dali, **SEES_8))
    assert report.ok and report.warnings == [] and report.device == "gpu"
    assert choose_device("auto", report) == "gpu" and choose_device("hybrid", report) == "hybrid"
    assert choose_device("cuda", report) == "gpu"


def test_no_driver_runs_on_the_cpu_and_a_gpu_device_is_refused():
    report = check(Stack(**TORCH_CU130, **DALI_130))
    assert report.ok and report.warnings == [] and choose_device("auto", report) == "cpu"
    with pytest.raises(StackMismatch, match=r"^--device gpu needs a CUDA GPU and this node has none \(no NVIDIA "
                                            r"driver answers and there is no /dev/nvidia<N>\): use --device cpu, "
                                            r"or auto$"):
        choose_device("gpu", report)


def test_two_majors_without_a_gpu_is_a_warning_not_a_refusal():
    """This machine's stack before the extras (torch cu130 + DALI cuda120): the CPU runs it, a GPU node would not."""
    report = check(Stack(**TORCH_CU130, **DALI_120))
    assert report.ok and choose_device("auto", report) == "cpu"
    assert report.warnings == [
        "torch 2.14.1+cu130 is built for CUDA 13.0 but DALI 2.4.0 (nvidia-dali-cuda120) for CUDA 12: install DALI "
        "for CUDA 13: pip uninstall -y nvidia-dali-cuda120 && pip install 'nvidia-dali-cuda130>=2.0' (no GPU here, "
        "so the CPU runs it)"]


@pytest.mark.parametrize("visible", ["", "-1"])
def test_gpus_hidden_by_cuda_visible_devices_run_on_the_cpu(visible):
    """NVML lists GPUs whatever CUDA_VISIBLE_DEVICES says; an empty list is how a user asks for the CPU."""
    report = check(Stack(**R535, **TORCH_CU130, **DALI_120, cuda_visible_devices=visible))
    assert report.ok and choose_device("auto", report) == "cpu"
    with pytest.raises(StackMismatch, match=f"CUDA_VISIBLE_DEVICES='{visible}' hides its GPUs"):
        choose_device("gpu", report)


def test_device_files_without_nvml_say_how_to_start_the_container():
    report = check(Stack(device_files=("/dev/nvidia0", "/dev/nvidia1"), host_gpus=(
        "/proc/driver/nvidia/gpus/0000:07:00.0", "/proc/driver/nvidia/gpus/0000:0f:00.0"), **TORCH_CU130, **DALI_130))
    assert report.problems == [
        "this node has 2 NVIDIA GPU(s) (/dev/nvidia0, /dev/nvidia1) but NVML does not answer: load the NVIDIA driver "
        "(nvidia-smi shows whether it runs); in a container, run it with --gpus all (the NVIDIA Container Toolkit "
        "mounts the driver)"]


def test_cuda_without_nvml_is_a_gpu_node_whose_libraries_are_still_checked():
    """No libnvidia-ml.so.1 (a container with NVIDIA_DRIVER_CAPABILITIES=compute): no driver version to compare,
    but torch's and DALI's own device counts show their CUDA runs; two majors or a CPU-only torch still stop it.
    The injected-NVML cases are in tests/test_nvml_injected.py."""
    files = dict(device_files=("/dev/nvidia0",))
    fits = check(Stack(**files, **TORCH_CU130, **DALI_130, torch_gpus=1, dali_gpus=1))
    assert fits.ok and fits.device == "gpu" and fits.notes == [
        "NVML not available: no GPU statistics; the container needs NVIDIA_DRIVER_CAPABILITIES=compute,utility for "
        "them"]
    other = check(Stack(**files, **TORCH_CU130, **DALI_130, torch_gpus=1, dali_gpus=1, nvml_error="Driver Not Loaded"))
    assert other.ok and other.notes == ["NVML not available (Driver Not Loaded): no GPU statistics"]
    two_majors = check(Stack(**files, **TORCH_CU130, **DALI_120, torch_gpus=1, dali_gpus=1))
    assert two_majors.device == "refused" and two_majors.problems[0].startswith(
        "torch 2.14.1+cu130 is built for CUDA 13.0 but DALI 2.4.0 (nvidia-dali-cuda120) for CUDA 12")
    cpu_torch = check(Stack(**files, torch="2.14.1+cpu", **DALI_130, dali_gpus=1))
    assert cpu_torch.problems == ["torch 2.14.1+cpu is a CPU-only build (torch.version.cuda is None) on a node with 1 "
                                  "NVIDIA GPU(s): pip install --force-reinstall torch torchvision --index-url "
                                  "https://download.pytorch.org/whl/cu130"]


def test_a_cuda_11_driver_is_told_to_upgrade():
    report = check(Stack(driver="470.256.02", driver_cuda="11.4", nvml_gpus=EIGHT, **TORCH_CU126, **DALI_120))
    assert report.problems == ["driver 470.256.02 runs CUDA up to 11.4; torch and DALI need CUDA 12 (driver >= "
                               "525.60.13) or 13 (>= 580.65.06): upgrade the NVIDIA driver"]


@pytest.mark.parametrize("driver, install", [(R535, INSTALL[12]), (R580, INSTALL[13]), ({}, INSTALL[13])])
def test_without_dali_the_install_for_the_driver_is_named(driver, install):
    report = check(Stack(**driver, **TORCH_CU130))
    assert report.problems[0] == ("NVIDIA DALI is not installed (the base install leaves its CUDA build to you): "
                                  + install)
    with pytest.raises(StackMismatch, match="NVIDIA DALI is not installed"):
        choose_device("auto", report)


def test_two_dali_builds_over_one_folder_are_both_removed_and_one_reinstalled():
    report = check(Stack(**TORCH_CU130, dali="2.4.0", dali_packages=("nvidia-dali-cuda120", "nvidia-dali-cuda130")))
    assert report.problems == [
        "2 DALI builds are installed over one nvidia/dali folder (nvidia-dali-cuda120, nvidia-dali-cuda130): keep the "
        "one for CUDA 13: pip uninstall -y nvidia-dali-cuda120 nvidia-dali-cuda130 && pip install "
        "'nvidia-dali-cuda130>=2.0'"]


def test_versions_that_fit_but_a_library_that_sees_no_gpu_points_at_cudas_own_error():
    torch_blind = check(Stack(**R580, **TORCH_CU130, **DALI_130, dali_gpus=8))
    assert torch_blind.problems == ["torch 2.14.1+cu130 sees no GPU although NVML lists 8: CUDA's own error: python "
                                    "-c \"import torch; torch.cuda.init()\""]
    dali_blind = check(Stack(**R580, **TORCH_CU130, **DALI_130, torch_gpus=8, cuda_visible_devices="0,1"))
    assert dali_blind.problems[0].startswith("DALI 2.4.0 sees no GPU although torch sees 8, CUDA_VISIBLE_DEVICES=0,1")


def test_dalis_cuda_major_comes_from_its_package_or_its_build():
    assert Stack(dali_packages=("nvidia-dali-nightly-cuda130",)).dali_majors == (13,)
    assert Stack(dali="2.4.0", dali_cuda_build=12986).dali_majors == (12,)  # int('12.9.86'.replace('.', ''))
    assert Stack(dali="2.4.0", dali_cuda_build=13088).dali_majors == (13,)


def test_loaders_and_dali_train_take_the_same_decision():
    """One rule: the loaders' resolve_device and dali-train's setup both refuse the R535 + cu130 node, and both
    run on the CPU where there is no GPU."""
    refused = check(Stack(**R535, **TORCH_CU130, **DALI_120))
    with pytest.raises(StackMismatch, match="torch 2.14.1"):
        resolve_device("auto", refused)
    with pytest.raises(StackMismatch, match="torch 2.14.1"):
        setup("auto", refused)
    no_gpu = check(Stack(**TORCH_CU130, **DALI_130))
    assert resolve_device("auto", no_gpu) == "cpu" and setup("auto", no_gpu).device.type == "cpu"


@pytest.fixture
def r535_node(monkeypatch):
    """This process seen as an 8-GPU R535 node with PyPI's torch: `probe` is dalifeed's own reader of the machine,
    replaced here so that every command's real path (click, config, setup, loaders) runs against that node."""
    import dalifeed.stack

    monkeypatch.setattr(dalifeed.stack, "probe", lambda: Stack(**R535, **TORCH_CU130, **DALI_120))


@pytest.mark.parametrize("device", ["auto", "gpu", "hybrid"])
def test_dali_train_on_a_node_whose_gpus_it_cannot_use_stops_in_one_line(r535_node, make_shards, tmp_path, device):
    from dalifeed.train.cli import main as train_cli

    shards = make_shards({"a": 5, "b": 4}, samples_per_shard=4)[1]
    result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "run"), "--model",
                                            "resnet18", "--width", "8", "--epochs", "1", "--device", device])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert errors == [result.output.strip().splitlines()[-1]] and len(errors) == 1  # one line, no traceback
    assert errors[0].startswith("Error: driver 535.104.05 runs CUDA up to 12.2 but torch 2.14.1+cu130")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_gpu_check_and_dali_bench_stop_on_it_too(r535_node, make_shards, tmp_path):
    from dalifeed.bench.cli import main as bench_cli
    from dalifeed.bench.gpu_check import main as gpu_check_cli

    result = CliRunner().invoke(gpu_check_cli, ["--workdir", str(tmp_path / "gc"), "--allow-cpu"])
    assert result.exit_code == 2 and "Error: driver 535.104.05 runs CUDA up to 12.2" in result.output, result.output
    tree, shards = make_shards({"a": 5, "b": 4}, samples_per_shard=4)
    result = CliRunner().invoke(bench_cli, ["--imagefolder", str(tree / "train" if (tree / "train").is_dir() else tree),
                                            "--shards", str(shards), "--out", str(tmp_path / "bench"),
                                            "--batch-size", "2", "--seconds", "0.1", "--repeats", "1"])
    assert result.exit_code == 2 and "Error: driver 535.104.05 runs CUDA up to 12.2" in result.output, result.output


@pytest.mark.parametrize("script", ["dali_train", "dali_bench"])
def test_the_dali_commands_start_or_say_in_one_line_that_dali_does_not_import(script):
    start = f"import sys; sys.argv = ['x', '--help']; from dalifeed.entry import {script}; {script}()"
    run = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("Usage: x "), run.stderr
    hidden = "import sys; sys.modules['nvidia.dali'] = None; " + start  # what an import failure looks like
    run = subprocess.run([sys.executable, "-c", hidden], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert re.fullmatch(r"Error: NVIDIA DALI \(nvidia-dali-cuda1[23]0\) is installed but does not import \(import of "
                        r"nvidia\.dali halted; None in sys\.modules\): python -c \"import nvidia\.dali\" shows why\n",
                        run.stderr), run.stderr


DALI_HIDDEN = "import sys; sys.modules['nvidia.dali'] = None; "  # what a missing DALI looks like to an import
DALI_LINE = (r"Error: NVIDIA DALI \(nvidia-dali-cuda1[23]0\) is installed but does not import \(import of "
             r"nvidia\.dali halted; None in sys\.modules\): python -c \"import nvidia\.dali\" shows why\n")


# no `nvidia` package at all (a CPU-only torch brings none): every nvidia.* import fails at `nvidia` itself
NVIDIA_HIDDEN = ("import sys\nclass Gone:\n    def find_spec(self, name, path=None, target=None):\n"
                 "        if name.split('.')[0] == 'nvidia':\n"
                 "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
                 "sys.meta_path.insert(0, Gone())\n")


@pytest.mark.parametrize("hidden", ["nvidia.dali", "nvidia"])
@pytest.mark.parametrize("module, args", [
    ("dalifeed.train.cli", ["--data", "{shards}", "--out", "{tmp}/run", "--epochs", "1"]),  # torchrun -m's form
    ("dalifeed.convert.cli", ["verify", "--decode", "{shards}"]),
])
def test_every_entry_point_names_the_missing_dali_install_in_one_line(make_shards, tmp_path, module, args, hidden):
    shards = make_shards({"a": 5, "b": 4}, samples_per_shard=4)[1]
    args = [a.format(shards=shards, tmp=tmp_path) for a in args]
    start = (DALI_HIDDEN if hidden == "nvidia.dali" else NVIDIA_HIDDEN) + \
        f"import runpy; sys.argv = ['x', *{args!r}]; runpy.run_module({module!r}, run_name='__main__')"
    run = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", run.stdout + run.stderr
    if hidden == "nvidia.dali":
        assert re.fullmatch(DALI_LINE, run.stderr), run.stderr
    else:
        assert re.fullmatch(r"Error: NVIDIA DALI \(nvidia-dali-cuda1[23]0\) is installed but does not import \(No "
                            r"module named 'nvidia'\): python -c \"import nvidia\.dali\" shows why\n", run.stderr), \
            run.stderr
    assert not (tmp_path / "run").exists()


def test_the_python_apis_first_dali_use_names_the_install():
    start = DALI_HIDDEN + "from dalifeed.pipelines import make_loader"
    run = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith(
        "ImportError: dalifeed.pipelines.make_loader needs NVIDIA DALI: NVIDIA DALI (nvidia-dali-cuda1"), run.stderr
    start = DALI_HIDDEN + "from dalifeed.convert.verify import dali_decoder; dali_decoder()"  # verify_shards' decoder
    run = subprocess.run([sys.executable, "-c", start], capture_output=True, text=True, timeout=120)
    assert "ImportError: NVIDIA DALI (nvidia-dali-cuda1" in run.stderr, run.stderr


# -- this machine, for real ----------------------------------------------------------------------------------

def test_this_machine_has_no_nvidia_driver_and_auto_runs_on_the_cpu():
    import nvidia.dali
    import torch

    stack = probe()
    assert ((stack.driver, stack.nvml_gpus, stack.device_files, stack.torch_gpus, stack.dali_gpus)
            == (None, (), (), 0, 0))
    assert stack.torch == torch.__version__ and stack.dali == nvidia.dali.__version__ and stack.dali_packages
    assert resolve_device("auto") == "cpu" and setup("auto").device.type == "cpu"


def test_dali_counts_gpus_with_the_call_its_backend_has():
    """DALI 2.4's backend_impl.cc defines GetCUDADeviceCount; the loaders called GetCudaDeviceCount, which it
    does not have, and took the AttributeError for "no GPU": 'auto' never chose the GPU, even on a GPU node."""
    from nvidia.dali import backend

    assert hasattr(backend, "GetCUDADeviceCount") and not hasattr(backend, "GetCudaDeviceCount")
    assert backend.GetCUDADeviceCount() == probe().dali_gpus == 0


def test_dali_builds_are_found_by_their_dist_info(tmp_path):
    for name in ("nvidia_dali_cuda120-2.4.0.dist-info", "nvidia_dali_nightly_cuda130-2.5.0.dev20260101.dist-info",
                 "nvidia_dali_tf_plugin_cuda120-2.4.0.dist-info", "nvidia_nvimgcodec_cu12-0.9.0.20.dist-info"):
        (tmp_path / name).mkdir()
    assert dali_distributions([str(tmp_path)]) == ("nvidia-dali-cuda120", "nvidia-dali-nightly-cuda130")


def test_nvidia_device_files_are_the_gpus_not_the_control_nodes(tmp_path):
    for name in ("nvidia0", "nvidia7", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (tmp_path / "dev").mkdir(exist_ok=True)
        (tmp_path / "dev" / name).touch()
    (tmp_path / "proc/driver/nvidia/gpus/0000:07:00.0").mkdir(parents=True)
    assert nvidia_device_files(tmp_path) == ("/dev/nvidia0", "/dev/nvidia7")
    assert host_gpu_entries(tmp_path) == ("/proc/driver/nvidia/gpus/0000:07:00.0",)
    assert nvidia_device_files(tmp_path / "nothing") == host_gpu_entries(tmp_path / "nothing") == ()


def gpu_host_root(root: Path, *, proc: int = 0, openable: int = 0, closed: int = 0, mig: bool = False) -> Path:
    """A machine's view as a folder: `proc` GPUs of the host in /proc/driver/nvidia/gpus, /dev/nvidia<N> files
    this process can open (`openable`: regular files) and files it cannot (`closed`: a directory, which
    open(O_RDWR) refuses as a cgroup's device rules refuse a device), and MIG's capability nodes."""
    (root / "dev").mkdir(parents=True)
    for i in range(proc):
        (root / f"proc/driver/nvidia/gpus/0000:{7 + i:02x}:00.0").mkdir(parents=True)
    for i in range(openable):
        (root / f"dev/nvidia{i}").touch()
    for i in range(openable, openable + closed):
        (root / f"dev/nvidia{i}").mkdir()
    (root / "dev/nvidiactl").touch()
    if mig:
        (root / "dev/nvidia-caps").mkdir()
        for cap in ("nvidia-cap1", "nvidia-cap2", "nvidia-cap66"):
            (root / "dev/nvidia-caps" / cap).touch()
    return root


def test_the_hosts_proc_alone_is_a_container_given_no_gpu(tmp_path):
    """docker build, a CPU pod on a GPU node, CI without --gpus: the host's /proc/driver/nvidia stays visible
    (libnvidia-container masks it only where it injects GPUs). auto runs on the CPU, with a note; gpu is
    refused naming why."""
    stack = probe(root=gpu_host_root(tmp_path, proc=2))
    assert stack.host_gpus == ("/proc/driver/nvidia/gpus/0000:07:00.0", "/proc/driver/nvidia/gpus/0000:08:00.0")
    assert (stack.device_files, stack.gpu_node, stack.given_no_gpu) == ((), False, True)
    report = check(stack)
    assert report.ok and report.device == "cpu" and choose_device("auto", report) == "cpu"
    assert report.notes == ["this container or job was given no GPU (the host lists 2 NVIDIA GPU(s) in "
                            "/proc/driver/nvidia/gpus): run it with --gpus all (Kubernetes: a nvidia.com/gpu limit) "
                            "to use them"]
    with pytest.raises(StackMismatch, match=r"^--device gpu needs a CUDA GPU and this node has none \(this container"):
        choose_device("gpu", report)


def test_device_files_it_cannot_open_are_a_job_given_no_gpu(tmp_path):
    """Slurm's ConstrainDevices: the node's /dev/nvidia<N> exist, the job's cgroup refuses to open them."""
    stack = probe(root=gpu_host_root(tmp_path, proc=2, closed=2))
    assert (stack.device_files, stack.closed_device_files) == ((), ("/dev/nvidia0", "/dev/nvidia1"))
    report = check(stack)
    assert report.ok and report.device == "cpu"
    assert report.notes[0].startswith("this container or job was given no GPU (/dev/nvidia0, /dev/nvidia1 cannot be "
                                      "opened by this process): ask the job for GPUs")


@pytest.mark.parametrize("layout", [dict(proc=2, openable=1, closed=1), dict(openable=2), dict(proc=1, openable=1,
                                                                                            mig=True)])
def test_device_files_it_can_open_are_gpus_it_must_be_able_to_use(tmp_path, layout):
    """GPUs given (a container with --gpus, a job's own GPU beside others' closed ones, a MIG instance's parent
    device with its capability nodes): a GPU node, and without NVML answering the loud refusal stays."""
    stack = probe(root=gpu_host_root(tmp_path, **layout))
    assert stack.gpu_node and not stack.given_no_gpu and len(stack.device_files) == layout.get("openable")
    report = check(stack)
    assert report.device == "refused" and report.notes == []
    assert "but NVML does not answer" in report.problems[0]
    with pytest.raises(StackMismatch, match="but NVML does not answer"):
        choose_device("auto", report)


def test_gpus_hidden_on_a_host_given_none_need_no_note():
    report = check(Stack(host_gpus=("/proc/driver/nvidia/gpus/0000:07:00.0",), cuda_visible_devices="",
                         **TORCH_CU130, **DALI_130))
    assert report.ok and report.notes == [] and report.device == "cpu"


# -- the installs ------------------------------------------------------------------------------------------

def declared() -> dict:
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return {"base": [Requirement(r) for r in project["dependencies"]],
            **{name: [Requirement(r) for r in reqs] for name, reqs in extras.items()}}


def test_the_base_install_brings_no_dali_and_each_cuda_extra_one_dali_of_its_major():
    deps = declared()
    dali = {name: [r.name for r in reqs if r.name.startswith("nvidia-dali")] for name, reqs in deps.items()}
    assert dali == {"base": [], "dev": [], "peers": [], "export": [], "cuda12": ["nvidia-dali-cuda120"],
                    "cuda13": ["nvidia-dali-cuda130"]}
    torch = {name: [str(r.specifier) for r in reqs if r.name == "torch"] for name, reqs in deps.items()}
    # PyPI's torch is built for CUDA 13.0 from 2.11 on (2.10: CUDA 12.8), measured: the cuda13 extra asks for it
    assert torch == {"base": [">=2.5"], "dev": [], "peers": [], "export": [], "cuda12": [], "cuda13": [">=2.11"]}


def test_the_installs_named_by_the_check_are_the_extras():
    assert INSTALL == {12: "pip install -e '.[cuda12]' --extra-index-url https://download.pytorch.org/whl/cu126",
                       13: "pip install -e '.[cuda13]'"}
    readme, gpu_doc = (ROOT / "README.md").read_text(), (ROOT / "docs" / "gpu.md").read_text()
    for command in INSTALL.values():
        assert command in readme and command in gpu_doc


@pytest.mark.parametrize("version, requires, major", [
    ("2.14.1+cu126", [], 12), ("2.9.1+cu130", [], 13), ("2.14.1+cpu", [], None),
    ("2.10.0", ['nvidia-cuda-runtime-cu12==12.8.90; platform_system == "Linux" and platform_machine == "x86_64"'], 12),
    ("2.14.1", ['cuda-toolkit[cublas,cudart,cufft]==13.0.3; platform_system == "Linux"'], 13),
    ("2.14.1", ["nvidia-cuda-runtime==13.0.96"], 13), ("2.14.1", ["sympy>=1.13.3", "filelock"], None)])
def test_torchs_cuda_major_is_read_from_its_metadata(version, requires, major):
    assert torch_build_major(version, requires) == major


@pytest.mark.parametrize("report, majors", [
    ("cuda13", {"torch": 13, "nvidia-dali-cuda130": 13}),
    ("cuda12-pypi", {"torch": 12, "nvidia-dali-cuda120": 12}),
    ("old-base", {"torch": 13, "nvidia-dali-cuda120": 12}),  # before the extras: the mixed stack
    ("cuda12-index-unreachable", {"torch": 13, "nvidia-dali-cuda120": 12}),  # pip only warns: the check must catch it
    ("base", {"torch": 13})])
def test_measured_pip_reports_resolve_one_cuda_major(report, majors):
    """`pip install --dry-run --report` of each documented install, measured (tests/data/pip-reports/README.md):
    one CUDA major each, where PyTorch's index answers; the two mixed ones are the failures `check` refuses."""
    assert install_majors(pip_report_packages(json.loads((REPORTS / f"{report}.json").read_text()))) == majors


def test_the_installed_stack_is_one_cuda_major():
    """This venv, as `make venv` installs it (`.[dev,cuda13]`): torch and DALI of one CUDA major."""
    majors = install_majors(installed_packages())
    assert "torch" in majors and any(name.startswith("nvidia-dali") for name in majors)
    assert len(set(majors.values())) == 1, majors


# -- dalifeed doctor ---------------------------------------------------------------------------------------

def test_doctor_prints_the_stack_and_the_verdict_here():
    result = CliRunner().invoke(dalifeed_cli, ["doctor"])
    assert result.exit_code == 0, result.output
    import torch

    lines = result.output.splitlines()
    assert lines[0] == "dalifeed doctor: the stack of this node"
    assert f"  torch        {torch.__version__} (CUDA {torch.version.cuda}); sees 0 GPU(s)" in lines
    assert "  driver       none answers (NVML: no libnvidia-ml.so.1)" in lines
    assert "verdict: OK: no NVIDIA GPU here; --device auto runs on the CPU" in lines
    assert f"  cuda12 (driver >= 525.60.13): {INSTALL[12]}" in lines


def test_doctor_json_from_the_console_script_module_has_every_field():
    run = subprocess.run([sys.executable, "-m", "dalifeed.cli", "doctor", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert {"python", "platform", "dalifeed", "torchvision", "cpu", "stack", "verdict", "installs"} <= set(doc)
    assert {"model", "machine_cpus", "usable_cores", "simd_flags", "torch_kernels"} <= set(doc["cpu"])
    stack = doc["stack"]
    assert {"driver", "driver_cuda", "nvml_gpus", "device_files", "torch", "torch_cuda", "torch_gpus", "dali",
            "dali_packages", "dali_cuda_build", "dali_gpus", "problems", "warnings"} <= set(stack)
    assert (stack["driver"], stack["gpu_node"], stack["ok"], stack["device_auto"]) == (None, False, True, "cpu")
    assert doc["installs"]["cuda13"] == {"driver_at_least": "580.65.06", "command": INSTALL[13]}
    assert doc["python"] == ".".join(map(str, sys.version_info[:3]))


def test_doctor_prints_each_problem_of_a_stack_that_does_not_fit():
    from dalifeed.doctor import collect, render

    doc = collect(check(Stack(**R535, **TORCH_CU130, **DALI_130)))
    text = render(doc)
    assert doc["verdict"] == "NOT OK: --device auto stops on this node (2 problem(s) below)"
    assert [line for line in text.splitlines() if line.startswith("  problem: ")] == \
        [f"  problem: {p}" for p in doc["stack"]["problems"]]
    assert "  GPUs         NVML: " + ", ".join(EIGHT) + "; device files: none" in text.splitlines()


def in_a_container_given_no_gpu(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`command` where the host's /proc/driver/nvidia lists a GPU and nothing else of it is there: a private
    mount namespace (unshare -m, as root) with a tmpfs on /proc/driver holding one GPU entry; what a
    container given no GPU sees on a GPU host. Skipped where this machine cannot make one."""
    script = ('mount -t tmpfs none /proc/driver && mkdir -p /proc/driver/nvidia/gpus/0000:07:00.0 && '
              'exec "$@"')
    probe_run = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", "true"], capture_output=True)
    if probe_run.returncode != 0:
        pytest.skip(f"no private mount of /proc/driver here: {probe_run.stderr.decode().strip()[:200]}")
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *command], capture_output=True, text=True,
                          **kwargs)


def test_doctor_and_dali_train_in_a_container_given_no_gpu(make_shards, tmp_path):
    """The Dockerfile runs `dalifeed doctor` at build time, on GPU build hosts too: it says OK (CPU) with the
    note, and `dali-train --device auto` trains on the CPU saying why in one line."""
    from fast_recipe import fast_args

    doctor = in_a_container_given_no_gpu([sys.executable, "-m", "dalifeed.cli", "doctor"], timeout=120)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "verdict: OK: this container or job was given no GPU (note below); --device auto runs on the CPU" in \
        doctor.stdout
    assert "  note: this container or job was given no GPU (the host lists 1 NVIDIA GPU(s) in /proc/driver/nvidia/" \
           "gpus): run it with --gpus all" in doctor.stdout

    shards = make_shards({"red": 9, "green": 8}, samples_per_shard=10)[1]
    train = in_a_container_given_no_gpu(
        [sys.executable, "-m", "dalifeed.train.cli", "--data", str(shards), "--out", str(tmp_path / "run"),
         "--epochs", "1", "--val-split", "none", "--device", "auto", *fast_args(width=8)], timeout=300)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    lines = [line for line in train.stdout.splitlines() if "given no GPU" in line]
    assert lines == ["--device auto: this container or job was given no GPU (the host lists 1 NVIDIA GPU(s) in "
                     "/proc/driver/nvidia/gpus): run it with --gpus all (Kubernetes: a nvidia.com/gpu limit) to use "
                     "them; training on the CPU"]
    assert "device cpu" in train.stdout
