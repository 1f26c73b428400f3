"""gpu-check's report for a person: the goals it judges, and gpu-check.md, one small function per section of
gpu-check.json (a section no step wrote is left out)."""

from __future__ import annotations

from .gpu_recipes import RECIPES as RECIPE_STEPS
from .report import markdown_table, render_table

GOAL_SPEEDUP = 8.0  # dali-gpu against the DataLoader with workers = cores
GOAL_TRAIN_SHARE = 0.95  # training on dali-gpu against the same trainer on synthetic data


def goals(report: dict) -> list[dict]:
    found = []
    loaders = {r["loader"]: r for r in (report.get("loaders") or {}).get("results", [])}
    if "dali-gpu" in loaders and loaders["dali-gpu"]["speedup_vs_baseline"]:
        speedup = loaders["dali-gpu"]["speedup_vs_baseline"]
        found.append({"goal": f"dali-gpu >= {GOAL_SPEEDUP:g}x the DataLoader baseline", "value": f"{speedup:.2f}x",
                      "met": speedup >= GOAL_SPEEDUP})
    train = report.get("train") or {}
    if "dali_vs_synthetic" in train:
        share = train["dali_vs_synthetic"]
        found.append({"goal": f"{train['model']} training on {train['loader']} within {1 - GOAL_TRAIN_SHARE:.0%} of "
                              f"synthetic data",
                      "value": f"{share:.1%}", "met": share >= GOAL_TRAIN_SHARE})
    return found


def render_markdown(report: dict) -> str:
    """gpu-check.md: a paragraph or table per section of `report` that a step wrote, in the order they run."""
    lines = []
    for key, render in SECTIONS:
        if report.get(key):
            lines += render(report[key]) + [""]
    return "\n".join(lines).rstrip() + "\n"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def decoder_memory_line(budget: dict) -> str:
    return (f"dali-train's default with one rank per GPU here, {budget['budget']}. At that budget each rank's "
            f"`mixed` decoder reserves {budget['gpu_mib']:.0f} MiB of GPU and {budget['pinned_mib']:.0f} MiB of "
            f"pinned host memory when built ({budget['device_padding_mib']:.0f} MiB + 2 x "
            f"{budget['host_padding_mib']:.0f} MiB per thread; twice that at an epoch's boundary, with the next "
            f"epoch's started: docs/gpu.md).")


# -- the sections, in order: each is given its part of the report and gives its lines -------------------

def node_section(env: dict) -> list[str]:
    return [f"## gpu-check {env['date']}", "",
            f"GPU {env.get('gpu') or 'none'} (compute {env.get('gpu_capability', '-')}, "
            f"{env.get('gpu_memory_gb', '-')} GiB), driver {env.get('driver') or '-'}, CUDA {env.get('cuda')}, "
            f"cuDNN {env.get('cudnn')}; {env['cores']} cores ({env['cpu']}); torch {env['torch']}, torchvision "
            f"{env['torchvision']}, DALI {env['dali']}, webdataset {env['webdataset']}, Python {env['python']}."]


def tests_section(tests: dict) -> list[str]:
    if isinstance(tests.get("skipped"), str):  # a reason, not a count: the tests did not run
        summary = tests["skipped"]
    else:
        summary = f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"
        if tests.get("failures"):
            summary += f": {', '.join(tests['failures'])}"
    return ["### gpu tests", "", summary]


def loaders_section(loaders: dict) -> list[str]:
    cfg = loaders["config"]
    return ["### Loaders", "",
            f"{loaders['dataset']['images']} photos, batch {cfg['batch_size']}, {cfg['image_size']} px, fp16 output, "
            f"{cfg['workers']} workers/threads, median of {cfg['repeats']} x {cfg['seconds']} s:", "",
            render_table(loaders)]


HARDWARE_DECODER_USED = {True: "yes", False: "no (NVML saw the JPEG engine idle)",
                         None: "unknown (NVML reports no JPEG-engine utilisation here)"}


def hw_decoder_section(hw: dict) -> list[str]:
    if "runs" not in hw:
        return ["### hw_decoder_load", "", f"skipped: {hw['skipped']}"]
    rows = [[f"{r['hw_decoder_load']:g}", f"{r['images_per_s']:.0f}",
             ", ".join(f"{x:.0f}" for x in r["images_per_s_runs"]),
             percent(r["jpeg_engine_util_percent"]), percent(r["gpu_util_percent"])] for r in hw["runs"]]
    return ["### hw_decoder_load (dali-gpu)", "",
            *markdown_table(["hw_decoder_load", "images/s (median)", "runs", "JPEG engine %", "GPU %"], rows), "",
            f"Hardware JPEG decoder used: {HARDWARE_DECODER_USED[hw['hardware_decoder_used']]}. "
            f"Best hw_decoder_load here: {hw['best_hw_decoder_load']:g}"
            + (f", at one rank's {hw['threads']} DALI threads ({hw['budget']})" if "threads" in hw else "")
            + (f"; dalifeed's default: {hw['default_hw_decoder_load']:g} (`--hw-decoder-load` sets it)."
               if "default_hw_decoder_load" in hw else ".")]


def defaults_section(found: dict) -> list[str]:
    rows = [[str(r["threads"]), str(r["prefetch_queue_depth"]), f"{r['images_per_s']:.0f}"] for r in found["runs"]]
    best, default = found["best"], found["default"]
    return [f"### Loader defaults (training graph, `{found['device']}`)", "",
            *markdown_table(["DALI threads", "prefetch queue", "images/s"], rows), "",
            f"Best here: {best['threads']} threads, prefetch queue {best['prefetch_queue_depth']}; dalifeed's default "
            f"here: {default['threads']} threads, prefetch queue {default['prefetch_queue_depth']} "
            f"(hw_decoder_load {found['hw_decoder_load']:g}; docs/development/gpu-evidence.md, \"Defaults "
            f"from NVIDIA's published configurations\"). `dali-train --dali-threads N` and "
            f"`make_loader(prefetch_queue_depth=...)` set them."]


def train_section(train: dict) -> list[str]:
    rows = [[label, f"{train[name]['images_per_s']:.0f}", f"{train[name]['data_wait_share']:.1%}",
             percent(train[name]["gpu_util_percent"])]
            for name, label in (("dali", train["loader"]), ("synthetic", "synthetic (one batch, repeated)"))]
    trace = train["dali"].get("profile_trace")
    where = f", a torch profiler trace of 5 steps of the {train['loader']} run in `{trace}`" if trace else ""
    ranks = f", {train['ranks']} rank(s)" if "ranks" in train else ""
    return [f"### {train['model']} training slice (amp {train['amp']}, channels-last, "
            f"batch {train['batch_size']}{ranks})",
            "", *markdown_table(["data", "images/s (median of epochs)", "data wait", "GPU %"], rows), "",
            f"{train['loader']} / synthetic: {train['dali_vs_synthetic']:.1%}; the commands are in gpu-check.json"
            f"{where}."]


def checkpoint_section(ckpt: dict) -> list[str]:
    return ["### Mid-epoch DALI checkpoint", "",
            f"`{ckpt['device']}` loader: save {ckpt['save_seconds'] * 1000:.1f} ms ({ckpt['state_bytes']} bytes), "
            f"restore to first batch {ckpt['restore_to_first_batch_seconds']:.2f} s (a fresh loader's first "
            f"batch: {ckpt['first_batch_seconds']:.2f} s); {ckpt['batches_compared']} restored batches "
            f"bit-identical: {'yes' if ckpt['bit_identical'] else 'NO'} (max difference "
            f"{ckpt['max_abs_difference']:g})."]


def nccl_section(nccl: dict) -> list[str]:
    return ["### Collectives", "",
            f"{nccl['backend']} at world size 1: {'ok' if nccl['ok'] else 'FAILED'} ({nccl['note']})."]


def difference(value: float | None) -> str:
    return "shapes differ" if value is None else f"{value:.4f}"


def recipe_section(name: str):
    """The section of recipe step `name` (gpu_recipes.py): a row per output, and its training slice if any."""
    def render(section: dict) -> list[str]:
        rows = []
        for case in section["cases"]:
            gpu = case.get("gpu_vs_cpu") or {}
            rows.append([case["output"], f"{case['images_per_s']:.0f} ({case['device']})", f"{case['checksum']:.6g}",
                         f"{case['cpu_checksum']:.6g}", difference(case.get("mean_abs_difference")),
                         "yes" if case["matches_cpu"] else "NO",
                         difference(gpu.get("mean_abs_difference")) if gpu else "-"])
        lines = [f"### {name}: {section['recipe']}", "",
                 f"batch {section['batch_size']}, {section['batches']} timed batches after the first; checksum: "
                 f"the float64 sum of the first batch, against the cpu loader's with the same seed "
                 f"({section['cases'][0]['compared_device']} loader compared):", "",
                 *markdown_table(["output", "images/s", "checksum", "cpu checksum", "mean abs difference",
                                  "matches cpu", "gpu (nvJPEG) vs cpu"], rows)]
        train = section.get("train")
        if train:
            lines += ["", f"Training slice on {train['ranks']} rank(s): {train['images_per_s']:.0f} images/s "
                          f"(median of epochs), data wait {train['data_wait_share']:.1%}: `{train['command']}`."]
        return lines

    return render


def goals_section(goals: list[dict]) -> list[str]:
    rows = [[g["goal"], g["value"], "yes" if g["met"] else "no"] for g in goals]
    return ["### Goals", "", *markdown_table(["goal", "measured", "met"], rows)]


def errors_section(errors: dict) -> list[str]:
    return ["### Steps that failed", ""] + [f"- {step}: {error}" for step, error in errors.items()]


# (key in gpu-check.json, its section), in the order of gpu-check.md
SECTIONS = (("environment", node_section), ("decoder_memory", lambda budget: [decoder_memory_line(budget)]),
            ("tests", tests_section), ("loaders", loaders_section), ("hw_decoder", hw_decoder_section),
            ("defaults", defaults_section),
            ("train", train_section), ("checkpoint", checkpoint_section), ("nccl", nccl_section),
            *((name.replace("-", "_"), recipe_section(name)) for name in RECIPE_STEPS),
            ("goals", goals_section), ("errors", errors_section))
