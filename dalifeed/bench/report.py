"""What dali-bench's report (run.run_bench) looks like to a person: the markdown table the CLI prints and
`make bench` puts in docs/benchmarks.md, and bench.png."""

from __future__ import annotations

from pathlib import Path

from dalifeed.atomic import write_json_atomic


def markdown_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table (every report of the bench draws its tables with this)."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(row) + " |" for row in rows]


def render_table(report: dict) -> str:
    has_model = any("train_steps_per_s" in r for r in report["results"])
    head = ["loader", "images/s (median)", "runs min-max", "x baseline", "CPU %", "peak RSS MB", "epoch start"]
    if has_model:
        head += ["train steps/s", "vs synthetic", "data wait"]
    rows = []
    for r in report["results"]:
        runs = r["images_per_s_runs"]
        row = [r["loader"], f"{r['images_per_s']:.0f}", f"{min(runs):.0f}-{max(runs):.0f}",
               f"{r['speedup_vs_baseline']:.2f}" if r["speedup_vs_baseline"] else "-",
               f"{r['cpu_percent']:.0f}", f"{r['peak_rss_mb']:.0f}", epoch_start_cell(r)]
        if has_model:
            row += [f"{r['train_steps_per_s']:.2f}", f"{r['train_vs_synthetic']:.0%}", f"{r['data_wait_share']:.0%}"]
        rows.append(row)
    lines = markdown_table(head, rows)
    if report.get("synthetic"):
        s = report["synthetic"]
        lines.append(f"\nSynthetic on-device data: {s['model']} at {s['steps_per_s']:.2f} steps/s "
                     f"({s['images_per_s']:.0f} images/s).")
    return "\n".join(lines)


def epoch_start_cell(record: dict) -> str:
    """The pause before an epoch's first batch, in batch times ("-": no epoch began in the timed windows)."""
    value = record.get("epoch_start_batch_times")  # absent from reports written before the field existed
    return "-" if value is None else f"{value:.1f}"


def write_report(report: dict, out: Path) -> None:
    """OUT/bench.json and OUT/bench.png."""
    write_json_atomic(out / "bench.json", report)
    plot(report, out / "bench.png")


# One colour per loader, the same in every plot, so that plots of different runs read alike.
LOADER_COLOURS = {"baseline": "#888888", "webdataset": "#4c72b0", "dali-cpu": "#9bd24a", "dali-hybrid": "#e69f00",
                  "dali-gpu": "#3d6b00"}


def plot(report: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(report)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(report: dict):
    """bench.png's figure: throughput per loader (median, min-max, speed-up over the baseline) and, with
    --model, the training steps/s each loader sustains next to synthetic data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    with_model = any("train_steps_per_s" in r for r in results)
    fig, axes = plt.subplots(1, 2 if with_model else 1, figsize=(12 if with_model else 7, 4.2), squeeze=False)
    colours = [LOADER_COLOURS.get(r["loader"], "#cccccc") for r in results]
    loading_bars(axes[0][0], results, colours)
    if with_model:
        training_bars(axes[0][1], results, colours, report.get("synthetic") or {})
    env, cfg, data = report["environment"], report["config"], report.get("dataset", {})
    fig.suptitle(f"{data.get('name', '?')} ({data.get('split', '?')}, {data.get('images', '?')} images), "
                 f"{cfg['image_size']} px, batch {cfg['batch_size']}; {env['gpu'] or 'CPU only'}, {env['cores']} cores",
                 fontsize=10)
    fig.tight_layout()
    return fig


def loading_bars(ax, results: list[dict], colours: list[str]) -> None:
    """Throughput per loader: the median, the runs' min-max as error bars, the speed-up over the baseline."""
    medians = [r["images_per_s"] for r in results]
    low = [m - min(r["images_per_s_runs"]) for m, r in zip(medians, results)]
    high = [max(r["images_per_s_runs"]) - m for m, r in zip(medians, results)]
    bars = ax.bar([r["loader"] for r in results], medians, yerr=[low, high], capsize=4, color=colours)
    labels = [f"{r['images_per_s']:.0f}" + (f"\n{r['speedup_vs_baseline']:.2f}x" if r["speedup_vs_baseline"] else "")
              for r in results]
    ax.bar_label(bars, labels, padding=3, fontsize=9)
    ax.set_ylim(0, max(m + h for m, h in zip(medians, high)) * 1.3)  # room for the labels inside the frame
    ax.set_ylabel("images/s (median, bars: min-max)")
    ax.set_title("data loading")


def training_bars(ax, results: list[dict], colours: list[str], synthetic: dict) -> None:
    """--model: the training steps/s each loader sustains, against the dashed line of synthetic data."""
    rates = [r.get("train_steps_per_s", 0) for r in results]
    bars = ax.bar([r["loader"] for r in results], rates, color=colours)
    ax.bar_label(bars, [f"{r.get('train_vs_synthetic', 0):.0%}" for r in results], padding=3, fontsize=9)
    steps_per_s = synthetic.get("steps_per_s")
    if steps_per_s:
        ax.axhline(steps_per_s, color="black", linestyle="--", linewidth=1)
        ax.annotate("synthetic data", (0.01, steps_per_s), xycoords=("axes fraction", "data"), va="bottom", fontsize=8)
    ax.set_ylim(0, max(rates + [steps_per_s or 0]) * 1.3)
    ax.set_ylabel("train steps/s (% of synthetic)")
    ax.set_title(f"{synthetic.get('model', 'model')} training fed by each loader")
