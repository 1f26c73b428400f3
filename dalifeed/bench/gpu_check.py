"""`make gpu-check`: prove the GPU stack of one node in one command, and write down what it found.

    python -m dalifeed.bench.gpu_check --workdir build/gpu-check          # what `make gpu-check` runs
    python -m dalifeed.bench.gpu_check --steps loaders,hw-decoder         # some steps; the report merges

Each step adds its section to WORKDIR/gpu-check.json and gpu-check.md, in order: `tests` (the `gpu`-marked
tests), `loaders` (dali-bench, every loader), `hw-decoder` (dali-gpu at each --hw-loads value), `defaults` (DALI
threads and prefetch queues against dalifeed/defaults.py), `train` (a slice of dali-train against --synthetic),
one step per training recipe (gpu_recipes.py: each output on the GPU, its first batch checked against the CPU
path's), `checkpoint` (a restored DALI checkpoint, bit for bit) and `nccl` (the collectives at world size 1).
`main`'s --help lists them.

Where there is no GPU it stops with exit 2 unless --allow-cpu (then it runs every step that can run on
the CPU: that is how the check itself is tested).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path

import click
import torch

from dalifeed.atomic import write_atomic, write_json_atomic
from dalifeed.cliutil import default, run_command
from dalifeed.decode import DEFAULT_HW_DECODER_LOAD
from dalifeed.runtime import usable_cores

from . import gpu_recipes
from .config import BenchConfig
from .gpu_defaults import defaults_step
from .gpu_node import decoder_budget
from .gpu_report import decoder_memory_line, goals, render_markdown
from .names import LOADERS
from .photos import build_data
from .report import write_report
from .run import environment as bench_environment
from .run import run_bench
from .sampler import ResourceSampler, gpu_probes

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the source checkout holding dalifeed/ and tests/


class CheckUsageError(Exception):
    """A check that cannot run here: one line, exit 2."""


@dataclass
class GpuCheckConfig:
    workdir: Path = Path("build/gpu-check")
    steps: list[str] = field(default_factory=lambda: list(STEPS))  # every step (the table below), in order
    per_class: int = 1250  # 8 classes: 10,000 photos, 8,000 of them in train
    batch_size: int = 256
    image_size: int = 224
    seconds: float = 10.0
    repeats: int = 3
    workers: int = field(default_factory=usable_cores)
    hw_loads: list[float] = field(default_factory=lambda: [0.0, 0.65, 0.99])
    model: str = "resnet50"
    width: int | None = None
    amp: str = "bf16"
    train_epochs: int = 4  # the first is warm-up (cuDNN autotuning, allocator); the rest are reported
    train_ranks: int | None = None  # processes of the training slices; None: one per visible GPU (1 without)
    recipe_batches: int = 10  # timed batches of each recipe case (after one that builds the pipeline)
    coco_batch_size: int = 64  # multilabel and detection (COCO shards: ~12 x per_class / 10 images)
    allow_cpu: bool = False

    def validate(self, has_gpu: bool) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown:
            raise CheckUsageError(f"--steps: unknown {', '.join(unknown)} (choose from {', '.join(STEPS)})")
        if not has_gpu and not self.allow_cpu:
            raise CheckUsageError("no CUDA GPU visible to both torch and DALI here (torch.cuda.is_available() "
                                  f"is {torch.cuda.is_available()}): gpu-check proves a GPU node; run it on one "
                                  "(or pass --allow-cpu to exercise the check itself on the CPU)")
        for name, value in (("--per-class", self.per_class), ("--batch-size", self.batch_size),
                            ("--repeats", self.repeats), ("--workers", self.workers),
                            ("--train-epochs", self.train_epochs),
                            ("--train-ranks", 1 if self.train_ranks is None else self.train_ranks),
                            ("--recipe-batches", self.recipe_batches), ("--coco-batch-size", self.coco_batch_size)):
            if value < 1:
                raise CheckUsageError(f"{name} must be >= 1, got {value}")
        if any(not 0 <= load <= 1 for load in self.hw_loads):
            raise CheckUsageError(f"--hw-loads must lie in [0, 1], got {self.hw_loads}")

    def to_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


# -- what the node is ------------------------------------------------------------------------------

def environment(has_gpu: bool) -> dict:
    from importlib import metadata

    env = bench_environment()
    env.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if has_gpu else None,
               hw_decoder_load_default=DEFAULT_HW_DECODER_LOAD)
    for name in ("nvidia-nvimgcodec-cu13", "nvidia-nvimgcodec-cu12", "nvidia-nvjpeg", "nvidia-nvjpeg-cu12"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    if has_gpu:
        env["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        env["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        env["driver"] = driver_version()
    return env


def driver_version() -> str | None:
    """The NVIDIA driver's version as NVML gives it, or None where NVML does not answer."""
    from dalifeed.nvml import open_gpu

    gpu = open_gpu(0)
    if gpu is None:
        return None
    try:
        return gpu[0].nvmlSystemGetDriverVersion()
    except Exception:  # an NVML without it: no figure, never a failed check
        return None


# -- the steps: each is `step(run) -> dict`, the section it adds to the report ----------------------------

@dataclass
class CheckRun:
    """What every step is given: the options, whether torch and DALI both see a GPU, where to log, and the
    photo set with its shards (built by the first step that asks, then shared)."""
    cfg: GpuCheckConfig
    has_gpu: bool
    log: Callable[[str], None] = print

    @cached_property
    def photo_set(self) -> tuple[Path, Path]:
        return photo_shards(self.cfg, self.log)

    @cached_property
    def coco_shards(self) -> Path:
        return gpu_recipes.coco_shards(self.cfg, self.log)

    @property
    def photos(self) -> Path:
        return self.photo_set[0]

    @property
    def shards(self) -> Path:
        return self.photo_set[1]

    @property
    def device(self) -> str:
        return "gpu" if self.has_gpu else "cpu"

    def train_slice(self, name: str, synthetic: bool, extra: list[str] | tuple = ()) -> dict:
        """`train_slice` of this run (what a recipe step calls for its training slice)."""
        return train_slice(self, name, synthetic, extra)

    @property
    def train_ranks(self) -> int:
        """Processes of a training slice: --train-ranks, else one per visible GPU (torchrun --nproc-per-node
        gpu, as a node trains), else 1."""
        return self.cfg.train_ranks or (torch.cuda.device_count() if self.has_gpu else 1)


def photo_shards(cfg: GpuCheckConfig, log) -> tuple[Path, Path]:
    """make bench's photo set and shards, built once per --per-class and reused by later calls."""
    stamp = cfg.workdir / "photos.json"
    wanted = {"per_class": cfg.per_class, "seed": 0}
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return cfg.workdir / "photos", cfg.workdir / "photos-shards"
    log(f"building {cfg.per_class} photos per class (8 classes) and their shards in {cfg.workdir} ...")
    stamp.unlink(missing_ok=True)
    data = build_data(cfg.workdir, cfg.per_class, workers=cfg.workers)
    write_json_atomic(stamp, wanted)  # last: an interrupted build is built again
    return data


def tests_step(run: CheckRun) -> dict:
    """The `gpu`-marked tests, from the source checkout this package sits in."""
    tests = PACKAGE_ROOT / "tests"
    if not tests.is_dir():
        return {"skipped": f"no tests/ next to the dalifeed package ({PACKAGE_ROOT}): run from a source checkout"}
    report = run.cfg.workdir / "gpu-tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={report}",
               str(tests)]
    exit_code = subprocess.run(command, cwd=PACKAGE_ROOT).returncode
    if not report.is_file():
        return {"command": shlex.join(command), "exit_code": exit_code, "failed": 1, "passed": 0, "skipped": 0,
                "failures": ["pytest wrote no report"]}
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failures = [f"{case.get('classname')}.{case.get('name')}" for case in suite.iter("testcase")
                if case.find("failure") is not None or case.find("error") is not None]
    return {"command": shlex.join(command), "exit_code": exit_code, "passed": total - skipped - len(failures),
            "failed": len(failures), "skipped": skipped, "failures": failures}


def bench_options(run: CheckRun, loaders: list[str], out: str) -> BenchConfig:
    """dali-bench's options for the photo set at gpu-check's batch, size, window and workers (fp16 batches),
    not yet validated (validation refuses dali-gpu where there is no GPU)."""
    cfg = run.cfg
    return BenchConfig(imagefolder=run.photos / "train", shards=run.shards, loaders=loaders, out=cfg.workdir / out,
                       batch_size=cfg.batch_size, image_size=cfg.image_size, seconds=cfg.seconds,
                       repeats=cfg.repeats, workers=cfg.workers, fp16=True)


def loaders_step(run: CheckRun) -> dict:
    """dali-bench with every loader: its report, also written to WORKDIR/loaders/bench.{json,png}."""
    bench = bench_options(run, list(LOADERS), "loaders")
    report = run_bench(bench, bench.validate(), log=run.log)
    bench.out.mkdir(parents=True, exist_ok=True)
    write_report(report, bench.out)
    return report


def utilisation(sampler: ResourceSampler) -> dict:
    """Mean GPU and JPEG-engine utilisation over a sampled window (None where NVML gave none)."""
    return {"gpu_util_percent": sampler.mean("gpu_util_percent"),
            "jpeg_engine_util_percent": sampler.mean("jpeg_engine_util_percent")}


def hw_decoder_config(run: CheckRun, threads: int) -> BenchConfig:
    """dali-bench's options for the sweep: dali-gpu alone, at `threads` DALI threads (one rank's, not --workers)."""
    return replace(bench_options(run, ["dali-gpu"], "hw"), workers=threads)


def hw_decoder_step(run: CheckRun) -> dict:
    """dali-gpu at each hardware-decoder share, with the JPEG engine's utilisation while it runs, at the DALI
    threads one dali-train rank gets on this node: the share that keeps a rank fed depends on how many
    threads feed its decoder, and a rank never has every core (budget.py)."""
    if not run.has_gpu:
        return {"skipped": "no GPU"}
    budget = decoder_budget()  # dali-train's default for one rank per visible GPU
    checked = hw_decoder_config(run, budget["threads"])  # same data for every load: checked and opened once
    dataset = checked.validate()
    run.log(f"hw-decoder: {budget['budget']}")
    runs = []
    for load in run.cfg.hw_loads:
        bench = replace(checked, hw_decoder_load=load, out=run.cfg.workdir / f"hw-{load:g}")
        run.log(f"hw_decoder_load {load:g}:")
        with ResourceSampler(gpu_probes()) as sampler:
            report = run_bench(bench, dataset, log=run.log)
        result = report["results"][0]
        runs.append({"hw_decoder_load": load, "images_per_s": result["images_per_s"],
                     "images_per_s_runs": result["images_per_s_runs"], **utilisation(sampler)})
    best = max(runs, key=lambda r: r["images_per_s"])
    engine = [r["jpeg_engine_util_percent"] for r in runs if r["hw_decoder_load"] > 0]
    used = None if not engine or None in engine else any(u > 0 for u in engine)
    return {"runs": runs, "best_hw_decoder_load": best["hw_decoder_load"], "hardware_decoder_used": used,
            "default_hw_decoder_load": DEFAULT_HW_DECODER_LOAD, "threads": budget["threads"],
            "budget": budget["budget"]}


def train_command(cfg: GpuCheckConfig, shards: Path, out: Path, has_gpu: bool, synthetic: bool, ranks: int = 1,
                  extra: list[str] | tuple = ()) -> list[str]:
    """dali-train's command for a slice: under torchrun with `ranks` processes on this node (what a node runs;
    dali-train sets each rank's GPU from LOCAL_RANK), or a plain process for one rank."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] \
        if ranks > 1 else [sys.executable]
    command = [*launcher, "-m", "dalifeed.train.cli", "--data", str(shards), "--out", str(out),
               "--model", cfg.model, "--epochs", str(cfg.train_epochs), "--batch-size", str(cfg.batch_size),
               "--image-size", str(cfg.image_size), "--amp", cfg.amp if has_gpu else "off", "--channels-last",
               "--val-split", "none", "--warmup-epochs", "0", "--device", "gpu" if has_gpu else "cpu"]
    # no --dali-threads: the slice checks the DALI threads dali-train gives a rank by default (its first
    # line says how many), which is what a user's run gets
    if cfg.width:
        command += ["--width", str(cfg.width)]
    # a torch profiler trace of steps 3-7 of the first epoch (which the numbers leave out): where the time
    # goes when a goal is missed
    return command + (["--synthetic"] if synthetic else ["--profile", "5"]) + list(extra)


def train_step(run: CheckRun) -> dict:
    """The same dali-train command on the shards and on synthetic data; epochs after the first compared."""
    cfg, has_gpu = run.cfg, run.has_gpu
    runs = {name: train_slice(run, name, synthetic) for name, synthetic in (("dali", False), ("synthetic", True))}
    share = runs["dali"]["images_per_s"] / runs["synthetic"]["images_per_s"]
    return {"model": cfg.model, "loader": "dali-gpu" if has_gpu else "dali-cpu", "amp": cfg.amp if has_gpu else "off",
            "channels_last": True, "ranks": run.train_ranks,
            "batch_size": cfg.batch_size, **runs, "dali_vs_synthetic": share}


def train_slice(run: CheckRun, name: str, synthetic: bool, extra: list[str] | tuple = ()) -> dict:
    """One dali-train run in WORKDIR/train-NAME on the node's ranks (subprocesses, GPU sampled meanwhile) and
    its steady epochs; `extra`: more dali-train options."""
    out = run.cfg.workdir / f"train-{name}"
    if out.exists():
        shutil.rmtree(out)
    command = train_command(run.cfg, run.shards, out, run.has_gpu, synthetic, ranks=run.train_ranks, extra=extra)
    run.log(f"train ({name}): {shlex.join(command)}")
    out.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
    with ResourceSampler(gpu_probes()) as sampler, open(out / "train.log", "w") as output:
        exit_code = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, env=env).returncode
    if exit_code != 0:
        tail = (out / "train.log").read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"dali-train ({name}) exited {exit_code}: {tail[0]} (log: {out / 'train.log'})")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = records[1:] or records
    trace = out / "profile_trace.json"
    return {"command": shlex.join(command), "ranks": run.train_ranks, "epochs_reported": len(steady),
            "profile_trace": str(trace) if trace.is_file() else None,
            "images_per_s": statistics.median(r["images_per_s"] for r in steady),
            "images_per_s_epochs": [r["images_per_s"] for r in steady],
            "data_wait_share": statistics.median(r["data_wait_share"] for r in steady),
            # the training pipeline is rebuilt every epoch: memory that grows epoch after epoch is a leak
            "gpu_process_memory_gb_epochs": [r.get("gpu_process_memory_gb") for r in records],
            "gpu_memory_used_gb_epochs": [r.get("gpu_memory_used_gb") for r in records], **utilisation(sampler)}


def checkpoint_loader(shards: Path, device: str, batch_size: int, image_size: int, workers: int,
                      hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD):
    """The loader the checkpoint step saves and restores: fp16 training batches with DALI checkpointing."""
    from dalifeed.pipelines import AugmentConfig, make_loader

    return make_loader(shards, "train", batch_size, augment=AugmentConfig(image_size=image_size), device=device,
                       num_threads=workers, train=True, checkpointing=True, fp16=True, seed=0,
                       hw_decoder_load=hw_decoder_load)


def checkpoint_round_trip(shards: Path, device: str, batch_size: int, image_size: int, workers: int,
                          before: int = 3, after: int = 3, hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD) -> dict:
    """Take `before` batches, save the loader's state, take `after` more; a fresh loader restored from the
    state must yield exactly those `after` batches."""
    def loader():
        return checkpoint_loader(shards, device, batch_size, image_size, workers, hw_decoder_load)

    def on_host(batch):
        return tuple(t.detach().cpu().clone() for t in batch)

    first = loader()
    if len(first) < before + after:
        raise RuntimeError(f"the checkpoint step needs {before + after} batches of {batch_size}; the split has "
                           f"{len(first)}: use a larger --per-class or a smaller --batch-size")
    started = time.perf_counter()
    batches = iter(first)
    next(batches)
    first_batch_s = time.perf_counter() - started
    for _ in range(before - 1):
        next(batches)
    started = time.perf_counter()
    state = first.state_dict()
    save_s = time.perf_counter() - started
    expected = [on_host(next(batches)) for _ in range(after)]
    del batches, first
    second = loader()
    started = time.perf_counter()
    second.load_state_dict(state)
    resumed = iter(second)
    got = [on_host(next(resumed))]
    restore_s = time.perf_counter() - started
    got += [on_host(next(resumed)) for _ in range(after - 1)]
    identical = all(torch.equal(a, b) for pair in zip(expected, got) for a, b in zip(*pair))
    difference = max(float((a.float() - b.float()).abs().max()) for (a, _), (b, _) in zip(expected, got))
    return {"device": device, "hw_decoder_load": hw_decoder_load, "first_batch_seconds": first_batch_s,
            "save_seconds": save_s, "restore_to_first_batch_seconds": restore_s,
            "state_bytes": len(state["dali"] or ""), "batches_compared": after, "bit_identical": identical,
            "max_abs_difference": difference}


def checkpoint_step(run: CheckRun) -> dict:
    cfg = run.cfg
    return checkpoint_round_trip(run.shards, run.device, cfg.batch_size, cfg.image_size, cfg.workers)


def collectives(has_gpu: bool) -> dict:
    """dalifeed's collectives and a DDP backward in a process group of one (NCCL on a GPU, gloo without)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dalifeed.train.distributed import all_reduce_min, all_reduce_sum, gather_objects

    backend = "nccl" if has_gpu else "gloo"
    device = torch.device("cuda", 0) if has_gpu else torch.device("cpu")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if has_gpu else None)
    try:
        summed = all_reduce_sum(torch.ones(2, device=device)).tolist()
        least = all_reduce_min(torch.tensor([3.0], device=device)).item()
        gathered = gather_objects({"rank": 0})
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(8, 2).to(device), device_ids=[0] if has_gpu else None)
        model(torch.randn(4, 8, device=device)).square().sum().backward()
        grads = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    finally:
        dist.destroy_process_group()
    ok = summed == [1.0, 1.0] and least == 3.0 and gathered == [{"rank": 0}] and grads
    note = "one GPU: NCCL between two processes cannot run here; this is the same code at world size 1" if has_gpu \
        else "no GPU: gloo, the CPU backend, in place of NCCL"
    return {"backend": backend, "world_size": 1, "ok": ok, "note": note}


def nccl_step(run: CheckRun) -> dict:
    return collectives(run.has_gpu)


# --steps NAME -> the step; its section in gpu-check.json is NAME with "_" for "-" (hw-decoder: hw_decoder)
STEPS: dict[str, Callable[[CheckRun], dict]] = {
    "tests": tests_step, "loaders": loaders_step, "hw-decoder": hw_decoder_step, "defaults": defaults_step,
    "train": train_step, "checkpoint": checkpoint_step, "nccl": nccl_step,
    **{name: gpu_recipes.recipe_step(name) for name in gpu_recipes.RECIPES},  # each recipe the graphs run
}


def section_of(step: str) -> str:
    return step.replace("-", "_")


# -- the command -----------------------------------------------------------------------------------

def run_check(cfg: GpuCheckConfig, log=print) -> dict:
    """Run cfg.steps; merge their sections into WORKDIR/gpu-check.json (earlier calls' sections are kept)."""
    from dalifeed.stack import StackMismatch, choose_device, stack_report

    stack = stack_report()  # first: a node whose torch or DALI cannot use its GPUs stops here, in one line
    try:
        has_gpu = choose_device("auto", stack) == "gpu"  # as the loaders and dali-train decide
    except StackMismatch as e:
        raise CheckUsageError(str(e)) from None
    cfg.validate(has_gpu)
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    path = cfg.workdir / "gpu-check.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report.update(config=cfg.to_json(), stack=stack.to_json(), environment=environment(has_gpu),
                  decoder_memory=decoder_budget())
    env = report["environment"]
    log(f"gpu-check: {env.get('gpu') or 'no GPU'}, driver {env.get('driver') or '-'}, CUDA {env['cuda']}, torch "
        f"{env['torch']}, DALI {env['dali']}, {env['cores']} cores; hw_decoder_load default "
        f"{env['hw_decoder_load_default']}")
    log(decoder_memory_line(report["decoder_memory"]))
    errors = report.setdefault("errors", {})
    run = CheckRun(cfg, has_gpu, log)
    for step in cfg.steps:
        log(f"== {step}")
        try:
            report[section_of(step)] = STEPS[step](run)
            errors.pop(step, None)
        except Exception as e:  # one step failing must not hide what the others measure
            errors[step] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
            log(f"{step}: FAILED: {errors[step]}")
    report["goals"] = goals(report)
    write_json_atomic(path, report)
    write_atomic(cfg.workdir / "gpu-check.md", render_markdown(report).encode())
    return report


def failed(report: dict) -> bool:
    tests = report.get("tests") or {}
    checks = [report.get("checkpoint", {}).get("bit_identical", True), report.get("nccl", {}).get("ok", True)]
    return bool(report.get("errors")) or bool(tests.get("failed")) or not all(checks) or \
        bool(gpu_recipes.failed_cases(report))


def d(name: str):
    return default(GpuCheckConfig, name)


def split_list(kind):
    def parse(ctx, param, value: str):
        try:
            return [kind(v.strip()) for v in value.split(",") if v.strip()]
        except ValueError:
            raise click.BadParameter(f"a comma-separated list of {kind.__name__} values, got {value!r}") from None
    return parse


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--workdir", type=click.Path(path_type=Path), default=d("workdir"), show_default=True,
              help="Photos, shards, runs, gpu-check.json and gpu-check.md. Reused by later calls.")
@click.option("--steps", default=",".join(d("steps")), show_default=True, callback=split_list(str),
              help="Comma-separated subset, run in the order given; a later call adds its sections to the report.")
@click.option("--per-class", type=int, default=d("per_class"), show_default=True,
              help="Photos per class of the ImageNet-like set (8 classes, 80% train).")
@click.option("--batch-size", type=int, default=d("batch_size"), show_default=True)
@click.option("--image-size", type=int, default=d("image_size"), show_default=True)
@click.option("--seconds", type=float, default=d("seconds"), show_default=True, help="Each timed loader run.")
@click.option("--repeats", type=int, default=d("repeats"), show_default=True, help="Timed runs per loader (median).")
@click.option("--workers", type=int, default=d("workers"), show_default=True,
              help="DataLoader workers and DALI threads of the loader race and the checkpoint step (default: the "
                   "CPUs this process may use); the hw-decoder sweep, the recipe steps on a GPU and the training "
                   "slices use what dali-train gives one rank of this node.")
@click.option("--hw-loads", default=",".join(f"{v:g}" for v in d("hw_loads")), show_default=True,
              callback=split_list(float),
              help="hw_decoder_load values the hw-decoder step measures dali-gpu at.")
@click.option("--model", default=d("model"), show_default=True, help="torchvision model of the training slice.")
@click.option("--width", type=int, default=d("width"), help="ResNets: stage width of the training slice's model.")
@click.option("--amp", type=click.Choice(["bf16", "fp16", "off"]), default=d("amp"), show_default=True,
              help="Precision of the training slice (on the CPU: off).")
@click.option("--train-epochs", type=int, default=d("train_epochs"), show_default=True,
              help="Epochs of each training slice; the first is warm-up and not reported.")
@click.option("--train-ranks", type=int, default=d("train_ranks"),
              help="Processes (torchrun) of each training slice  [default: one per visible GPU; 1 without]")
@click.option("--recipe-batches", type=int, default=d("recipe_batches"), show_default=True,
              help="Timed batches of each recipe case, after the first (which builds the pipeline).")
@click.option("--coco-batch-size", type=int, default=d("coco_batch_size"), show_default=True,
              help="Batch of the multilabel and detection steps (at most --batch-size).")
@click.option("--allow-cpu", is_flag=True, help="Run what can run without a GPU (to test the check itself).")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
def main(debug: bool, **options) -> None:
    """Prove the GPU stack of this node: the gpu tests, every loader against the DataLoader, the hardware
    JPEG decoder's share, a ResNet-50 training slice against synthetic data, a mixed-decoder checkpoint
    round trip, the collectives, and every training recipe on the GPU against the CPU path; writes
    WORKDIR/gpu-check.json and gpu-check.md and prints the latter.

    \b
    Steps (--steps), in order:
      tests                        the gpu-marked tests (pytest -m gpu)
      loaders                      dali-bench, every loader, batch 256, 224 px, fp16
      hw-decoder                   dali-gpu at each --hw-loads, at one rank's DALI threads; the best
      defaults                     DALI threads 4/6/8 x prefetch 2/5: the best against the defaults
      train                        dali-train ResNet-50 bf16 on the node's ranks vs --synthetic
      checkpoint                   a mixed loader's DALI checkpoint restored bit for bit
      nccl                         the collectives and a DDP backward (world size 1)
      recipe-imagenet              AutoAugment (torchvision's ImageNet policy)
      recipe-ra                    RandAugment
      recipe-ta_wide               TrivialAugmentWide
      recipe-erase                 random erasing
      recipe-mixup-cutmix          mixup / cutmix on the device
      recipe-torchvision-resnet50  --recipe torchvision-resnet50: loader cases + a training slice
      multilabel                   COCO shards, multi-hot targets
      detection                    COCO shards, boxes
    Each recipe step runs float32 and float16, NCHW and NHWC (detection: float32): images/s on the GPU,
    and a checksum of the first batch against the CPU path (hybrid vs cpu: the same draws).

    \b
    Example (on a GPU node, from the source checkout):
      make gpu-check                                    # every step
      python -m dalifeed.bench.gpu_check --steps train  # one step again; the report keeps the others

    Exit codes: 0 every step ran and passed; 1 a step failed (named in the report), a gpu test failed, a
    restored checkpoint differed, or a recipe's batch differed from the CPU path's; 2 no GPU here (without
    --allow-cpu) or a bad option.
    """
    cfg = GpuCheckConfig(**options)
    report = run_command(lambda: run_check(cfg, log=lambda msg: click.echo(msg, err=True)), debug=debug,
                         usage_errors=(CheckUsageError,), log=lambda: None,
                         stopped=lambda e: "gpu-check.json holds what earlier calls measured, not this one")
    click.echo(render_markdown(report))
    click.echo(f"wrote {cfg.workdir / 'gpu-check.json'} and {cfg.workdir / 'gpu-check.md'}", err=True)
    if failed(report):
        sys.exit(1)


if __name__ == "__main__":
    main()
