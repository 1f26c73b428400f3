"""gpu-check's report for a person: the goals it judges, and gpu-check.md, one small function per section of
gpu-check.json (a section a step did not write is left out)."""

from __future__ import annotations

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
    """gpu-check.md: the sections of `report` in the order the steps run, each followed by a blank line."""
    lines = []
    for section in SECTIONS:
        lines += section(report)
    return "\n".join(lines).rstrip() + "\n"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def yes_no(value: bool) -> str:
    return "yes" if value else "no"


def decoder_memory_line(budget: dict) -> str:
    return (f"dali-train's default with one rank per GPU here, {budget['budget']}. At that budget each rank's "
            f"`mixed` decoder reserves {budget['gpu_mib']:.0f} MiB of GPU and {budget['pinned_mib']:.0f} MiB of pinned "
            f"host memory when built ({budget['device_padding_mib']:.0f} MiB + 2 x {budget['host_padding_mib']:.0f} MiB "
            f"per thread; a rank holds one at a time: docs/gpu.md).")


# -- the sections, in order: each takes the whole report and gives its lines ----------------------------

def node_section(report: dict) -> list[str]:
    env = report["environment"]
    return [f"## gpu-check {env['date']}", "",
            f"GPU {env.get('gpu') or 'none'} (compute {env.get('gpu_capability', '-')}, "
            f"{env.get('gpu_memory_gb', '-')} GiB), driver {env.get('driver') or '-'}, CUDA {env.get('cuda')}, "
            f"cuDNN {env.get('cudnn')}; {env['cores']} cores ({env['cpu']}); torch {env['torch']}, torchvision "
            f"{env['torchvision']}, DALI {env['dali']}, webdataset {env['webdataset']}, Python {env['python']}.", ""]


def decoder_memory_section(report: dict) -> list[str]:
    budget = report.get("decoder_memory")
    return [decoder_memory_line(budget), ""] if budget else []


def tests_section(report: dict) -> list[str]:
    tests = report.get("tests")
    if not tests:
        return []
    if isinstance(tests.get("skipped"), str):  # a reason, not a count: the tests did not run
        summary = tests["skipped"]
    else:
        summary = f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"
        if tests.get("failures"):
            summary += f": {', '.join(tests['failures'])}"
    return ["### gpu tests", "", summary, ""]


def loaders_section(report: dict) -> list[str]:
    loaders = report.get("loaders")
    if not loaders:
        return []
    cfg = loaders["config"]
    return ["### Loaders", "",
            f"{loaders['dataset']['images']} photos, batch {cfg['batch_size']}, {cfg['image_size']} px, fp16 output, "
            f"{cfg['workers']} workers/threads, median of {cfg['repeats']} x {cfg['seconds']} s:", "",
            render_table(loaders), ""]


HARDWARE_DECODER_USED = {True: "yes", False: "no (NVML saw the JPEG engine idle)",
                         None: "unknown (NVML reports no JPEG-engine utilisation here)"}


def hw_decoder_section(report: dict) -> list[str]:
    hw = report.get("hw_decoder")
    if not hw:
        return []
    if "runs" not in hw:
        return ["### hw_decoder_load", "", f"skipped: {hw['skipped']}", ""]
    rows = [[f"{r['hw_decoder_load']:g}", f"{r['images_per_s']:.0f}",
             ", ".join(f"{x:.0f}" for x in r["images_per_s_runs"]),
             percent(r["jpeg_engine_util_percent"]), percent(r["gpu_util_percent"])] for r in hw["runs"]]
    return ["### hw_decoder_load (dali-gpu)", "",
            *markdown_table(["hw_decoder_load", "images/s (median)", "runs", "JPEG engine %", "GPU %"], rows), "",
            f"Hardware JPEG decoder used: {HARDWARE_DECODER_USED[hw['hardware_decoder_used']]}. "
            f"Best hw_decoder_load here: {hw['best_hw_decoder_load']:g}.", ""]


def train_section(report: dict) -> list[str]:
    train = report.get("train")
    if not train:
        return []
    rows = [[label, f"{train[name]['images_per_s']:.0f}", f"{train[name]['data_wait_share']:.1%}",
             percent(train[name]["gpu_util_percent"])]
            for name, label in (("dali", train["loader"]), ("synthetic", "synthetic (one batch, repeated)"))]
    trace = train["dali"].get("profile_trace")
    where = f", a torch profiler trace of 5 steps of the {train['loader']} run in `{trace}`" if trace else ""
    return [f"### {train['model']} training slice (amp {train['amp']}, channels-last, batch {train['batch_size']})",
            "", *markdown_table(["data", "images/s (median of epochs)", "data wait", "GPU %"], rows), "",
            f"{train['loader']} / synthetic: {train['dali_vs_synthetic']:.1%}; the commands are in gpu-check.json"
            f"{where}.", ""]


def checkpoint_section(report: dict) -> list[str]:
    ckpt = report.get("checkpoint")
    if not ckpt:
        return []
    return ["### Mid-epoch DALI checkpoint", "",
            f"`{ckpt['device']}` loader: save {ckpt['save_seconds'] * 1000:.1f} ms ({ckpt['state_bytes']} bytes), "
            f"restore to first batch {ckpt['restore_to_first_batch_seconds']:.2f} s (a fresh loader's first "
            f"batch: {ckpt['first_batch_seconds']:.2f} s); {ckpt['batches_compared']} restored batches "
            f"bit-identical: {'yes' if ckpt['bit_identical'] else 'NO'} (max difference "
            f"{ckpt['max_abs_difference']:g}).", ""]


def nccl_section(report: dict) -> list[str]:
    nccl = report.get("nccl")
    if not nccl:
        return []
    return ["### Collectives", "",
            f"{nccl['backend']} at world size 1: {'ok' if nccl['ok'] else 'FAILED'} ({nccl['note']}).", ""]


def goals_section(report: dict) -> list[str]:
    if not report.get("goals"):
        return []
    rows = [[g["goal"], g["value"], yes_no(g["met"])] for g in report["goals"]]
    return ["### Goals", "", *markdown_table(["goal", "measured", "met"], rows), ""]


def errors_section(report: dict) -> list[str]:
    if not report.get("errors"):
        return []
    return ["### Steps that failed", ""] + [f"- {step}: {error}" for step, error in report["errors"].items()]


SECTIONS = (node_section, decoder_memory_section, tests_section, loaders_section, hw_decoder_section, train_section,
            checkpoint_section, nccl_section, goals_section, errors_section)
