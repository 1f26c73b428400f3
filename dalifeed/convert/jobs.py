"""One conversion in N independent jobs (`--num-jobs N --job-index I`, docs/scaling.md), and the one rule by
which parts of a conversion add up to its manifest.

Jobs split the same plan: with `--samples-per-shard` alone, shard k holds plan positions [kS, (k+1)S) and
job I writes a contiguous range of shard numbers, so the merged folder is byte-identical to a single-job
conversion; with byte-sized shards, job I converts a contiguous range of positions into shards named
`<split>-jIIII-NNNNNN`, holding the same samples as a single job would.

A job writes its part of OUT and a job record `OUT/.dalifeed-jobs/job-IIII-of-NNNN.json`: the manifest of its
part (what a re-run that finds the job done returns) and its skipped files and warnings per split.
`add_up_records` checks that all N records are there and were made alike, and adds them up with `add_up`, the
function a single job's manifest is made with too: a single job is the one part of its conversion.
`core.merge` (`shard-convert merge`) saves what they add up to, in OUT or in the store (`remote.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..atomic import write_json_atomic
from ..format import ShardManifest, SplitInfo, check_split_name
from .options import ShardOptions
from .shards import JOBS_DIR, PROGRESS_DIR, Totals, describe_difference


def job_positions(n: int, opts: ShardOptions) -> range:
    """The plan positions of a split of `n` items that job `opts.job_index` of `opts.num_jobs` converts (all
    of them for a single job)."""
    index, count = opts.job_index, opts.num_jobs
    if opts.max_shard_bytes is None:  # whole shards: a contiguous range of shard numbers
        shards = -(-n // opts.samples_per_shard)
        first, last = shards * index // count, shards * (index + 1) // count
        return range(min(n, first * opts.samples_per_shard), min(n, last * opts.samples_per_shard))
    return range(n * index // count, n * (index + 1) // count)


def shard_prefix(split: str, opts: ShardOptions) -> str:
    """How this job's shards of `split` are named: `<split>`, or `<split>-jIIII` for one of several jobs
    cutting byte-sized shards (its shard numbers cannot follow from plan positions)."""
    return f"{split}-j{opts.job_index:04d}" if opts.jobs and opts.max_shard_bytes is not None else split


def job_record_path(out: Path, index: int, count: int) -> Path:
    return out / JOBS_DIR / f"job-{index:04d}-of-{count:04d}.json"


@dataclass
class Part:
    """What one job (or the single job) adds to the manifest: its totals per split, and `plan`: what the
    plan found before encoding (files skipped while listing, its warnings and tallies), which job 0 accounts
    for."""

    splits: dict[str, Totals]
    plan: Totals = field(default_factory=Totals)


def add_up(template: ShardManifest, parts: list[Part]) -> ShardManifest:
    """`template` (kind, source, options, classes, found, extra, each split's listing) with the shards and
    tallies of `parts` (in job order) added up, listed in the order a single job lists them: the plan's
    warnings (found while listing) first, then split by split (within a split, job by job: plan order),
    then the files the plan skipped. Concatenating whole jobs instead would put job 0's val skips before
    job 1's train skips."""
    splits = {name: Totals.sum(part.splits[name] for part in parts) for name in template.splits}
    plan = Totals.sum(part.plan for part in parts)
    whole = Totals.sum([Totals(warnings=plan.warnings), *splits.values(),
                        Totals(skipped=plan.skipped, reencoded=plan.reencoded, counts=plan.counts)])
    extra = {**template.extra, "counts": dict(sorted(whole.counts.items()))}
    if not whole.counts:
        del extra["counts"]
    return replace(
        template, extra=extra, skipped=whole.skipped, warnings=whole.warnings,
        splits={name: SplitInfo(totals.shards, totals.class_counts(len(template.classes)),
                                template.splits[name].listing)
                for name, totals in splits.items()},
        reencoded={"count": sum(whole.reencoded.values()), "by_reason": dict(sorted(whole.reencoded.items()))},
    )


def write_job_record(opts: ShardOptions, manifest: ShardManifest, part: Part, summary: dict) -> None:
    """This job's record: the manifest of its part, and the lists `merge` needs to put every job's in a
    single job's order."""
    job = {"index": opts.job_index, "count": opts.num_jobs,
           "splits": {name: {"skipped": t.skipped, "warnings": t.warnings} for name, t in part.splits.items()},
           "plan": {"skipped": part.plan.skipped, "warnings": part.plan.warnings}}
    path = job_record_path(opts.folder, opts.job_index, opts.num_jobs)
    path.parent.mkdir(exist_ok=True)
    write_json_atomic(path, {**manifest.to_json(), "job": job, "summary": summary})


def part_of_record(record: dict, manifest: ShardManifest) -> Part:
    """A job's `Part`, from its record and the manifest of its part. The re-encodes and tallies are only
    known for the whole job; they are sums, so they go with its plan part."""
    job = record["job"]
    lists = job.get("splits")
    plan = job["plan"] if lists is not None else {"skipped": manifest.skipped, "warnings": manifest.warnings}
    lists = lists or {}  # a record of an older version: its lists whole, in job order
    splits = {name: Totals(list(info.shards), list(lists.get(name, {}).get("skipped", [])),
                           classes={str(c): n for c, n in enumerate(info.class_counts or [])},
                           warnings=list(lists.get(name, {}).get("warnings", [])))
              for name, info in manifest.splits.items()}
    return Part(splits, Totals(skipped=list(plan["skipped"]), warnings=list(plan["warnings"]),
                               reencoded=dict(manifest.reencoded.get("by_reason", {})),
                               counts=dict(manifest.extra.get("counts", {}))))


class MergeError(Exception):
    """A job is missing or was run differently: one line naming it."""


def add_up_records(out: Path) -> ShardManifest:
    """The manifest the job records in `out` add up to (rooted at `out`, not saved)."""
    records = finished_jobs(out)
    parts = [ShardManifest.from_json(out, record) for record in records]
    # the fingerprint of the whole conversion, as a single job would have written it: the folder is the same
    whole = {k: v for k, v in records[0]["fingerprint"].items() if k != "num_jobs"}
    template = replace(parts[0], extra={**parts[0].extra, "fingerprint": whole})
    return add_up(template, [part_of_record(record, part) for record, part in zip(records, parts)])


def finished_jobs(out: Path) -> list[dict]:
    """The records of every job of OUT's conversion, by job index; MergeError naming the first job missing or
    made with other input than job 0."""
    paths = sorted((out / JOBS_DIR).glob("job-*-of-*.json"))
    if not paths:
        raise MergeError(f"{out}: no job records in {out / JOBS_DIR} (is this the OUT of a --num-jobs conversion?)")
    docs = [read_job_record(p) for p in paths]
    count = docs[0]["job"]["count"]
    found = {doc["job"]["index"]: doc for doc in docs if doc["job"]["count"] == count}
    strays = [p.name for p, doc in zip(paths, docs) if doc["job"]["count"] != count]
    if strays:
        raise MergeError(f"{out}: job records of different --num-jobs ({', '.join(strays)} against {count})")
    missing = [i for i in range(count) if i not in found]
    if missing:
        running = [i for i in missing if (out / PROGRESS_DIR / f"job-{i:04d}").is_dir()]
        state = f" ({len(running)} of them started: still running or interrupted)" if running else ""
        raise MergeError(f"{out}: job {missing[0]} of {count} has not finished "
                         f"(no {job_record_path(out, missing[0], count).name})"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else "") + state)
    reference = found[0]["fingerprint"]
    for index in range(count):
        if found[index]["fingerprint"] != reference:
            raise MergeError(f"{out}: job {index} was made with other input than job 0: "
                             f"{describe_difference(reference, found[index]['fingerprint'])}")
    return [found[i] for i in range(count)]


def read_job_record(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc.get("job", {}).get("count"), int) or not isinstance(doc["job"].get("index"), int):
            raise ValueError("no job index and count")
        for split in doc.get("splits", {}):  # names the merged manifest gives its splits
            check_split_name(split)
    except (OSError, ValueError, AttributeError, KeyError) as e:
        raise MergeError(f"{path}: unreadable job record ({e}); run that job again") from None
    return doc
