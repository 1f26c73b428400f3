"""Every GPU graph dalifeed makes, checked on a machine without a GPU (`make gpu-lint`, gpu-evidence.md).

How far DALI 2.4 goes without CUDA: a pipeline with `mixed` and `gpu` operators and `device_id=None` can be
defined and serialized (`Pipeline.serialize()`, the protobuf the C++ backend is handed); only `build()` needs
the driver. Defining checks each argument's name and type against the operator's schema and serializing checks
that every input sits on a device its consumer accepts, but neither checks that the operator has a backend for
the device it is placed on: `fn.random_bbox_crop(device="gpu")` serializes and fails only in `build()`, on the
GPU node. So for each graph, built by the factory that builds it for real (make_loader, make_detection_loader,
the verify decoder, dali-bench's stage cuts, gpu-check's checkpoint loader), on `gpu` and `hybrid`:

(a) each operator has a backend for its device in the installed DALI (`nvidia.dali.ops.cpu_ops/gpu_ops/mixed_ops`);
(b) every argument is in the operator's schema, and neither it nor the operator is deprecated;
(c) the graph equals the same factory's `cpu` graph operator for operator, except device strings (a `.gpu()`
    transfer is the same edge on another device: DALI 2.4 inserts the copy when it builds, not in the graph it
    serializes) and the mixed decoders' DECODER_HINTS: "the devices differ only in device strings";
(d) every operator on the GPU has a kernel for the dtype (and layout) it receives: the `cpu` twin of the graph
    is run once with every operator's input added as an output, which gives the dtype and layout on each edge
    (the same edges as the GPU graph's, by (c)), and each GPU operator is held to DALI 2.4's GPU type list for it
    (tests/gpu_kernels.py, itself checked against the kernels the installed wheel instantiates).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import nvidia.dali
import pytest
import torch
from nvidia.dali import backend, fn, ops, pipeline_def, types

from dalifeed.decode import DEFAULT_HW_DECODER_LOAD, DaliDecoder, dali_sees_gpu, decoder_memory
from dalifeed.pipelines.augment import AugmentConfig
from dalifeed.pipelines.serialized import wire_fields, with_reader_arguments, without_origins
from gpu_kernels import GPU_KERNELS, input_problem

# Arguments only the mixed decoders get, each a no-op on the CPU backend (its schema doc says it applies only
# to `mixed`, or makes `mixed` do what `cpu` already does). gpu-evidence.md gives the evidence for each.
DECODER_HINTS = {
    "hw_decoder_load": "share of JPEGs for the A100/H100 hardware decoder",
    "device_memory_padding": "nvJPEG device buffer padding, preallocated per decoder thread",
    "host_memory_padding": "nvJPEG pinned buffer padding, two preallocated per decoder thread",
    "jpeg_fancy_upsampling": "nvJPEG upsamples chroma as libjpeg-turbo does on the CPU",
}
# Arguments DALI's Python front end adds to every operator's spec, outside any schema
# (nvidia/dali/ops/__init__.py: `AddArg("preserve_name", ...)`, the device; names starting with "_": the
# operator's display name, module and the source lines that defined it).
FRONT_END_ARGS = {"device", "preserve_name"}
ROI_DECODERS = {"decoders__ImageRandomCrop", "decoders__ImageSlice", "decoders__ImageCrop"}


# -- the serialized graph ------------------------------------------------------------------------
# DALI's wheel does not ship the Python bindings of its protobuf (dali/pipeline/proto/dali.proto, unchanged
# since 2022), so the few messages read here are decoded from the wire format directly.

def _fields(buf: bytes) -> dict[int, list]:
    """Protobuf wire format -> {field number: [values]}: varints as int, the others as bytes (the loader's own
    reader of the format, serialized.wire_fields)."""
    fields: dict[int, list] = {}
    for number, _, value, _ in wire_fields(buf):
        fields.setdefault(number, []).append(value)
    return fields


def _argument_value(fields: dict[int, list]):
    """dali_proto.Argument: floats = 3, ints = 4, strings = 5, bools = 6, extra_args = 7 (vector items),
    is_vector = 8. Returns a float, int, str or bool, or a tuple of them for a vector."""
    if fields.get(8, [0])[0]:
        return tuple(_argument_value(_fields(item)) for item in fields.get(7, []))
    values = [struct.unpack("<f", v)[0] for v in fields.get(3, [])]
    values += [v - 2**64 if v >= 2**63 else v for v in fields.get(4, [])]
    values += [v.decode() for v in fields.get(5, [])]
    values += [bool(v) for v in fields.get(6, [])]
    return values[0] if len(values) == 1 else tuple(values)


@dataclass(frozen=True)
class Edge:
    name: str
    device: str
    argument: str | None  # the keyword an argument input feeds, None for a regular input


@dataclass(repr=False)
class Op:
    schema: str  # the operator's schema name, e.g. decoders__ImageRandomCrop
    name: str  # its instance name in the graph
    inputs: list[Edge]
    outputs: list[Edge]
    args: dict

    @property
    def device(self) -> str:
        return self.args["device"]

    def __str__(self) -> str:
        return f"{self.name} ({self.schema}, {self.device})"

    __repr__ = __str__


def _edge(buf: bytes) -> Edge:
    """dali_proto.InputOutput: name = 1, device = 2, is_argument_input = 3, arg_name = 4."""
    f = _fields(buf)
    return Edge(f[1][0].decode(), f[2][0].decode(), f[4][0].decode() if f.get(3, [0])[0] else None)


def parse_graph(serialized: bytes) -> tuple[list[Op], list[Edge]]:
    """dali_proto.PipelineDef (op = 5, pipe_outputs = 7) -> its operators in order and its outputs."""
    pipeline = _fields(serialized)
    graph = []
    for op_buf in pipeline.get(5, []):
        f = _fields(op_buf)  # OpDef: name = 1, input = 2, output = 3, args = 4, inst_name = 5
        args = {}
        for arg_buf in f.get(4, []):
            arg = _fields(arg_buf)
            args[arg[1][0].decode()] = _argument_value(arg)
        graph.append(Op(f[1][0].decode(), f[5][0].decode(), [_edge(b) for b in f.get(2, [])],
                        [_edge(b) for b in f.get(3, [])], args))
    return graph, [_edge(b) for b in pipeline.get(7, [])]


# -- the three checks (each returns what it found wrong, one line per problem) ---------------------

def backend_problems(graph: list[Op]) -> list[str]:
    """(a) operators without a backend for their device in the installed DALI."""
    registered = {"cpu": ops.cpu_ops(), "gpu": ops.gpu_ops(), "mixed": ops.mixed_ops()}
    return [f"{op}: DALI {nvidia.dali.__version__} has no {op.device} backend for {op.schema}"
            for op in graph if op.schema not in registered[op.device]]


def schema_problems(graph: list[Op]) -> list[str]:
    """(b) arguments (and argument inputs) outside the operator's schema, deprecated ones, deprecated operators."""
    problems = []
    for op in graph:
        schema = backend.GetSchema(op.schema)
        if schema.IsDeprecated():
            problems.append(f"{op}: the operator is deprecated in favour of {schema.DeprecatedInFavorOf()}")
        names = [n for n in op.args if n not in FRONT_END_ARGS and not n.startswith("_")]
        names += [e.argument for e in op.inputs if e.argument]
        for name in names:
            if not schema.HasArgument(name):
                problems.append(f"{op}: argument {name!r} is not in the schema of {op.schema}")
            elif schema.IsDeprecatedArg(name):
                problems.append(f"{op}: argument {name!r} is deprecated ({schema.DeprecatedArgInfo(name)['msg']})")
    return problems


def comparable_args(op: Op) -> dict:
    # where in the source an operator was defined is not what it does
    return {k: v for k, v in op.args.items() if k != "device" and not k.startswith("_origin_stack")}


def difference_problems(cpu: tuple[list[Op], list[Edge]], other: tuple[list[Op], list[Edge]]) -> list[str]:
    """(c) how `other` (a gpu or hybrid graph) differs from the cpu graph beyond device strings, the edges
    `.gpu()` moves and DECODER_HINTS on mixed decoders."""
    (cpu_ops, cpu_outputs), (ops_, outputs) = cpu, other
    problems = []
    if [op.name for op in cpu_ops] != [op.name for op in ops_]:
        return [f"operators differ: cpu {[op.name for op in cpu_ops]}, this {[op.name for op in ops_]}"]
    for c, o in zip(cpu_ops, ops_):
        if c.schema != o.schema:
            problems.append(f"{o}: the cpu graph has {c.schema} here")
        if c.device != "cpu":
            problems.append(f"{c}: an operator of the cpu graph on {c.device}")
        if [(e.name, e.argument) for e in c.inputs] != [(e.name, e.argument) for e in o.inputs]:
            problems.append(f"{o}: inputs {o.inputs}, the cpu graph's {c.inputs}")
        if [e.name for e in c.outputs] != [e.name for e in o.outputs]:
            problems.append(f"{o}: outputs {o.outputs}, the cpu graph's {c.outputs}")
        ca, oa = comparable_args(c), comparable_args(o)
        hints = {k for k in oa.keys() - ca.keys() if k in DECODER_HINTS and o.device == "mixed"}
        for name in sorted((ca.keys() | oa.keys()) - hints):
            if ca.get(name, "<unset>") != oa.get(name, "<unset>"):
                problems.append(f"{o}: {name}={oa.get(name, '<unset>')!r}, the cpu graph's {ca.get(name, '<unset>')!r}")
    if [e.name for e in cpu_outputs] != [e.name for e in outputs]:
        problems.append(f"pipeline outputs {outputs}, the cpu graph's {cpu_outputs}")
    return problems


# -- the graphs, from the factories that build them ---------------------------------------------

def on_device(loader, device: str):
    """`loader` with its graph on `device`. make_loader and make_detection_loader refuse 'gpu' and 'hybrid'
    on a node without GPUs (resolve_device), and the device string is all their graph takes from that choice
    (device_id stays None: DALI's current device, only looked up by build())."""
    from dalifeed.pipelines.definitions import EpochDefinitions

    twin = copy.copy(loader)
    twin.options = dataclasses.replace(loader.options, device=device)
    twin.definitions = EpochDefinitions(loader.plan, twin.options, loader.definitions.epoch_graph)
    return twin


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    return make_shards({"a": 9, "b": 8}, samples_per_shard=6)[1]


def classification(shards_dir, train: bool, split: str = "train", *, augment=None, flip: bool = True,
                   dtype=torch.float32, multilabel: bool = False, **options):
    """The loader's graph for these options: `augment` (default 32 px, `flip`), float16 for `dtype`, COCO's
    multi-hot targets with `multilabel`; `options`: the other loader options."""
    from dalifeed.pipelines import AugmentConfig, make_loader, open_dataset

    data = open_dataset(shards_dir, task="multilabel" if multilabel else "classify")
    augment = augment or AugmentConfig(image_size=32, flip=flip)
    loader = make_loader(data, split, 2, augment=augment, train=train, device="cpu", num_threads=2,
                         fp16=dtype == torch.float16, **options)
    return lambda device: on_device(loader, device).pipeline()


DETECTION_FIELDS = ("size", "min_size", "max_size", "crop", "flip", "include_crowd")


def detection(coco_dir, train: bool, **options):
    """The detection loader's graph: its DetectionConfig's fields and loader options, as keywords."""
    from dalifeed.pipelines import DetectionConfig, make_detection_loader

    config = DetectionConfig(**{k: options.pop(k) for k in DETECTION_FIELDS if k in options})
    loader = make_detection_loader(coco_dir, "mini", 2, detection=config, train=train, device="cpu", num_threads=2,
                                   **options)
    return lambda device: on_device(loader, device).pipeline()


def bench_stage(shards_dir, stage: int):
    from dalifeed.bench.stages import cut_pipeline
    from dalifeed.format import ShardManifest

    manifest = ShardManifest.load(shards_dir)
    paths = [str(p) for p in manifest.shard_paths("train")]
    indexes = [str(p) for p in manifest.index_paths("train")]
    return lambda device: cut_pipeline(paths, indexes, AugmentConfig(image_size=32), device, stage, batch_size=4,
                                       num_threads=2, device_id=None, seed=0)


def bench_loader(shards_dir):
    from dalifeed.bench.loaders import race_loader

    loader = race_loader("dali-cpu", imagefolder=shards_dir, shards=shards_dir, split="train", batch_size=4,
                          image_size=32, workers=2, device=torch.device("cpu"), fp16=True, hw_decoder_load=0.3)
    return lambda device: on_device(loader, device).pipeline()


def bench_detection_loader(coco_dir):
    from dalifeed.bench.detection import build_detection_loader

    loader = build_detection_loader("dali-cpu", images=None, annotations=None, shards=coco_dir, split="mini",
                                    batch_size=2, image_size=64, workers=2, device=torch.device("cpu"),
                                    hw_decoder_load=0.2)
    return lambda device: on_device(loader, device).pipeline()


def checkpoint_loader(shards_dir):
    from dalifeed.bench.gpu_check import checkpoint_loader as gpu_check_loader

    loader = gpu_check_loader(shards_dir, "cpu", batch_size=4, image_size=32, workers=2, hw_decoder_load=0.99)
    return lambda device: on_device(loader, device).pipeline()


def verify_decoder(device: str):
    return DaliDecoder(device, None, batch_size=4, num_threads=2).pipeline()


def recipe(policy: str | None, random_erase: float = 0.5) -> AugmentConfig:
    return AugmentConfig(image_size=32, auto_augment=policy, random_erase=random_erase)


BOTH = ("gpu", "hybrid")
# name -> (how to make it from the fixtures, the non-cpu devices dalifeed builds it for). Every output dtype a
# loader hands out: float32 and float16 (make_loader refuses others; a bf16 model takes the float32 batches,
# autocast casts inside it), NCHW and NHWC (channels_last), with and without each policy and erasing.
GRAPHS = {
    "train": (lambda s, c: classification(s, True), BOTH),
    "val": (lambda s, c: classification(s, False), BOTH),
    "train-fp16": (lambda s, c: classification(s, True, dtype=torch.float16), BOTH),
    "val-fp16": (lambda s, c: classification(s, False, dtype=torch.float16), BOTH),
    "train-channels_last": (lambda s, c: classification(s, True, channels_last=True), BOTH),
    "val-channels_last": (lambda s, c: classification(s, False, channels_last=True), BOTH),
    "train-fp16-channels_last": (lambda s, c: classification(s, True, dtype=torch.float16, channels_last=True), BOTH),
    "train-hw_decoder_load_0.99": (lambda s, c: classification(s, True, hw_decoder_load=0.99), BOTH),
    "train-no_flip": (lambda s, c: classification(s, True, flip=False), BOTH),
    **{f"train-{policy}-random_erase": (lambda s, c, policy=policy: classification(
        s, True, augment=recipe(policy)), BOTH) for policy in ("imagenet", "ra", "ta_wide")},
    **{f"train-{policy}-random_erase-fp16": (lambda s, c, policy=policy: classification(
        s, True, augment=recipe(policy), dtype=torch.float16), BOTH) for policy in ("imagenet", "ra", "ta_wide")},
    "train-ta_wide-random_erase-fp16-channels_last": (lambda s, c: classification(
        s, True, augment=recipe("ta_wide"), dtype=torch.float16, channels_last=True), BOTH),
    "train-random_erase-fp16-channels_last": (lambda s, c: classification(
        s, True, augment=recipe(None), dtype=torch.float16, channels_last=True), BOTH),
    "train-ta_wide-channels_last": (lambda s, c: classification(
        s, True, augment=recipe("ta_wide", 0.0), channels_last=True), BOTH),
    "multilabel-train": (lambda s, c: classification(c, True, "mini", multilabel=True), BOTH),
    "multilabel-val": (lambda s, c: classification(c, False, "mini", multilabel=True), BOTH),
    "detection-train-size": (lambda s, c: detection(c, True, size=64), BOTH),
    "detection-val-size": (lambda s, c: detection(c, False, size=64), BOTH),
    "detection-train-min_max_size": (lambda s, c: detection(c, True, min_size=48, max_size=80), BOTH),
    "detection-val-min_max_size": (lambda s, c: detection(c, False, min_size=48, max_size=80), BOTH),
    "detection-train-no_crop": (lambda s, c: detection(c, True, size=64, crop=False), BOTH),
    "detection-train-crowd-no_flip": (lambda s, c: detection(c, True, size=64, include_crowd=True, flip=False),
        BOTH),
    "detection-train-hw_decoder_load_0.99": (lambda s, c: detection(c, True, size=64, hw_decoder_load=0.99), BOTH),
    "detection-val-hw_decoder_load_0.99": (lambda s, c: detection(c, False, size=64, hw_decoder_load=0.99), BOTH),
    "detection-train-no_crop-hw_decoder_load_0.99": (
        lambda s, c: detection(c, True, size=64, crop=False, hw_decoder_load=0.99), BOTH),
    # verify's decoder on a GPU; a `hybrid` loader re-decodes with DaliDecoder("hybrid"), which is the cpu graph
    "verify-decoder": (lambda s, c: verify_decoder, ("gpu",)),
    "dali-bench-loader": (lambda s, c: bench_loader(s), BOTH),
    "dali-bench-detection-loader": (lambda s, c: bench_detection_loader(c), BOTH),
    # make_bench cuts the graph on `gpu` or `cpu` only (stages.stage_rates); the cut after "read" has no device
    **{f"dali-bench-stage{stage}": (lambda s, c, stage=stage: bench_stage(s, stage), ("gpu",)) for stage in (1, 2, 3)},
    "gpu-check-checkpoint-loader": (lambda s, c: checkpoint_loader(s), ("gpu",)),
}
CASES = [(name, device) for name, (_, devices) in GRAPHS.items() for device in devices]


def encoded_jpegs(batch_size: int) -> list:
    """What verify's decoder is fed (an external source) when its cpu twin is run for (d)."""
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((20, 24, 3), 90, np.uint8)).save(buf, "JPEG")
    return [np.frombuffer(buf.getvalue(), np.uint8)] * batch_size


FEEDS = {"verify-decoder": {"encoded": encoded_jpegs}}  # graph -> external source -> batch_size -> its batch


@pytest.fixture(scope="module")
def graph(shards, mini_coco_shards):
    """graph(name, device) -> the serialized graph, parsed (made once per module)."""
    made, factories = {}, {}

    def get(name: str, device: str):
        if name not in factories:
            factories[name] = GRAPHS[name][0](shards, mini_coco_shards)
        if (name, device) not in made:
            made[name, device] = parse_graph(factories[name](device).serialize())
        return made[name, device]

    return get


# -- (d): the dtype and layout on every edge, from running the cpu twin ------------------------------

PROBE_BATCH, PROBE_RUNS = 64, 6  # enough samples that every branch of every policy is taken (a seeded draw)


def observed_inputs(pipe, feeds: dict | None = None, batch_size: int = PROBE_BATCH,
                    runs: int = PROBE_RUNS) -> dict[str, tuple[str, str]]:
    """Edge name -> (DALI dtype name, layout) of every operator input of `pipe`, a cpu graph defined but not
    built: a pipeline of the same operators whose outputs are all those inputs, run `runs` times. An edge
    inside a policy's branch that no sample took in a run carries an empty batch without a type; it is read
    from the runs in which samples took it, and is missing when none did. `feeds`: external source -> a
    function of the batch size giving its batch. (`_build_graph` and `_ops` are DALI 2.4's own graph walk,
    nvidia/dali/pipeline.py: the public API gives the dtypes of a pipeline's outputs only.)"""
    from nvidia.dali import Pipeline

    pipe._build_graph()
    edges = {}
    for op in pipe._ops:
        for node in op.inputs:
            for edge in node if isinstance(node, list) else [node]:
                edges[edge.name] = edge
    probe = Pipeline(batch_size=batch_size, num_threads=2, device_id=None, seed=3, exec_async=False,
                     exec_pipelined=False, prefetch_queue_depth=1)
    with probe:
        probe.set_outputs(*edges.values())
    probe.build()
    seen: dict[str, tuple[str, str]] = {}
    for _ in range(runs):
        for name, make in (feeds or {}).items():
            probe.feed_input(name, make(batch_size))
        for name, batch in zip(edges, probe.run()):
            if batch.dtype != types.NO_TYPE:
                seen[name] = (batch.dtype.name, batch.layout())
    return seen


def dtype_problems(graph: list[Op], observed: dict[str, tuple[str, str]]) -> list[str]:
    """(d) operators off the CPU that are not in gpu_kernels.GPU_KERNELS, or whose input has a dtype or layout
    their DALI 2.4 GPU kernel does not take."""
    problems = []
    for op in graph:
        if op.device == "cpu":
            continue
        kernel = GPU_KERNELS.get(op.schema)
        if kernel is None:
            problems.append(f"{op}: {input_problem(op.schema, None, None)}")
            continue
        for edge in [e for e in op.inputs if e.argument is None][:kernel.inputs]:  # [:None]: every input
            problem = input_problem(op.schema, *observed.get(edge.name, (None, None)))
            if problem:
                problems.append(f"{op}: {problem}")
    return problems


@pytest.fixture(scope="module")
def observed(shards, mini_coco_shards):
    """observed(name) -> observed_inputs of graph `name`'s cpu twin (run once per module)."""
    made: dict[str, dict] = {}

    def get(name: str):
        if name not in made:
            made[name] = observed_inputs(GRAPHS[name][0](shards, mini_coco_shards)("cpu"), FEEDS.get(name))
        return made[name]

    return get


# -- the checks on every graph --------------------------------------------------------------------

@pytest.mark.parametrize("name,device", CASES)
def test_every_operator_has_a_backend_for_its_device(graph, name, device):
    ops_, _ = graph(name, device)
    assert backend_problems(ops_) == []
    if device == "gpu":  # the decoders really are on the GPU
        assert all(op.device == "mixed" for op in ops_ if op.schema.startswith("decoders__"))
    else:
        assert all(op.device == "cpu" for op in ops_ if op.schema.startswith("decoders__"))


@pytest.mark.parametrize("name,device", CASES + [(name, "cpu") for name in GRAPHS])
def test_every_argument_is_in_the_schema_and_current(graph, name, device):
    ops_, _ = graph(name, device)
    assert schema_problems(ops_) == []


@pytest.mark.parametrize("name,device", CASES)
def test_the_graph_equals_the_cpu_graph_but_for_devices_and_decoder_hints(graph, name, device):
    assert difference_problems(graph(name, "cpu"), graph(name, device)) == []
    _, outputs = graph(name, device)
    # what the iterator hands to torch lives on the GPU; a checkpointing training loader's last output, where
    # each sample was read (graphs.sample_sources), stays on the CPU, where the loader reads it
    sources = name == "gpu-check-checkpoint-loader"
    assert [e.device for e in outputs] == ["gpu"] * (len(outputs) - sources) + ["cpu"] * sources


@pytest.mark.parametrize("name,device", CASES)
def test_every_gpu_kernel_has_the_dtype_and_layout_it_receives(graph, observed, name, device):
    ops_, _ = graph(name, device)
    assert dtype_problems(ops_, observed(name)) == []


def test_float16_output_erases_in_float32_and_casts_after(graph, observed):
    """Issue 28: the fp16 training graph erases the float32 normalised image, then casts (what (d) reads)."""
    ops_, _ = graph("train-ta_wide-random_erase-fp16", "gpu")
    seen = observed("train-ta_wide-random_erase-fp16")
    erase = next(op for op in ops_ if op.schema == "Erase")
    assert (erase.device, seen[erase.inputs[0].name]) == ("gpu", ("FLOAT", "CHW"))
    assert (ops_[-1].schema, ops_[-1].args["dtype"]) == ("Cast", int(types.FLOAT16))


def test_the_dtype_check_fails_the_float16_erasing_graph_of_before(shards):
    """The composition train_augment had before issue 28, normalise to float16 then erase, serializes and runs
    on the CPU; (d) names the GPU erase that would have failed on the first batch."""
    from dalifeed.format import ShardManifest
    from dalifeed.pipelines import augment, graphs

    manifest = ShardManifest.load(shards)
    paths, indexes = [str(p) for p in manifest.shard_paths("train")], [str(p) for p in manifest.index_paths("train")]
    cfg, out = AugmentConfig(image_size=32, random_erase=0.5), graphs.Output(fp16=True)

    @pipeline_def(batch_size=4, num_threads=1, device_id=None, seed=0)
    def before(device):
        jpegs, _ = graphs.read_shards(paths, indexes, shard_id=0, num_shards=1, shuffle=False, initial_fill=4)
        images = graphs.resize_square(graphs.after_decode(graphs.decode_random_crop(jpegs, cfg, device), device), cfg)
        return augment.random_erase(graphs.normalize(images, cfg, out), cfg)

    gpu = parse_graph(before("gpu").serialize())[0]
    assert backend_problems(gpu) == [] and schema_problems(gpu) == []  # the old checks let it through
    problems = dtype_problems(gpu, observed_inputs(before("cpu")))
    assert len(problems) == 1 and "(Erase, gpu): Erase gets FLOAT16; DALI 2.4's GPU kernel takes FLOAT, INT16" in \
        problems[0], problems
    assert dtype_problems(parse_graph(before("hybrid").serialize())[0], observed_inputs(before("cpu"))) == problems


def test_an_operator_missing_from_the_kernel_table_is_named():
    cpu_only_op_on_the_gpu, _ = _broken_graphs()
    ops_, _ = parse_graph(cpu_only_op_on_the_gpu().serialize())
    assert dtype_problems(ops_, {}) == [f"{ops_[-1]}: RandomBBoxCrop is not in tests/gpu_kernels.py: "
                                        "read its GPU type list in DALI 2.4's source and add it"]


# The kernels the installed DALI instantiates, from the mangled names in libdali_operators.so (Itanium C++ ABI:
# h uint8_t, a int8_t, t uint16_t, s int16_t, j uint32_t, i int32_t, m uint64_t, l int64_t, f float, d double,
# b bool; dali::float16 is a nested name, NS_7float16E). Schema -> (pattern, the group that is the input type).
MANGLED = {b"h": "UINT8", b"a": "INT8", b"t": "UINT16", b"s": "INT16", b"j": "UINT32", b"i": "INT32", b"m": "UINT64",
           b"l": "INT64", b"f": "FLOAT", b"d": "FLOAT64", b"b": "BOOL"}
T = rb"(NS\d*_7float16E|[hatsjimlfdb])"
WITNESSES = {
    "Erase": (rb"12EraseImplGpuI" + T, 1),  # EraseImplGpu<T, ndim, channel_dim>
    "CropMirrorNormalize": (rb"21SliceFlipNormalizeGPUI" + T + T, 2),  # <Out, In, spatial_ndim, channel_dim>
    "Resize": (rb"15ResizeOpImplGPUI" + T + T, 2),  # <Out, In, spatial_ndim>
    "Flip": (rb"7kernels7FlipGPUI" + T, 1),
    "Pad": (rb"3PadINS_10GPUBackendEE8FillArgsINS_7kernels9SliceArgsI" + T, 1),
    "Brightness": (rb"14MultiplyAddGpuI" + T + T, 2),  # brightness_contrast's GPU kernel <Out, In, ndim>
    "BrightnessContrast": (rb"14MultiplyAddGpuI" + T + T, 2),
    "WarpAffine": (rb"7WarpGPUINS\d*_13AffineMappingILi2EEELi2E" + T + T, 2),  # <Mapping, 2, Out, In, Border>
    "Rotate": (rb"7WarpGPUINS\d*_13AffineMappingILi2EEELi2E" + T + T, 2),  # the same Warp kernels
    "Filter": (rb"9FilterGpuI" + T + T, 2),  # <Out, In, W, ...>
    "reductions__Min": (rb"6MinGPUI" + T + T, 2),
    "reductions__Max": (rb"6MaxGPUI" + T + T, 2),
    "reductions__Sum": (rb"6SumGPUI" + T + T, 2),
    "reductions__Mean": (rb"7MeanGPUI" + T + T, 2),
    "Cast": (rb"4cast7CastGPUI" + T + T, 2),
    "CastLike": (rb"4cast7CastGPUI" + T + T, 2),
    "_ArithmeticGenericOp": (rb"12InvokerBinOpILNS\d*_12ArithmeticOpE\d+E" + T + T + T, 2),  # <op, Out, Left, Right>
}


def instantiated(library: bytes, pattern: bytes, group: int) -> set[str]:
    return {"FLOAT16" if b"float16" in m.group(group) else MANGLED[m.group(group)]
            for m in re.finditer(pattern, library)}


def test_the_kernel_table_is_what_the_installed_dali_instantiates():
    """Every row of gpu_kernels.GPU_KERNELS with a templated GPU kernel lists exactly the input types the
    installed DALI 2.4 wheel has kernels for; the rest (the decoders, equalize, and the type-agnostic copies)
    rest on the source alone. And the CPU erase has the float16 kernel its GPU twin lacks: why only a GPU
    failed."""
    library = (Path(nvidia.dali.__file__).parent / "libdali_operators.so").read_bytes()
    for schema, (pattern, group) in WITNESSES.items():
        assert instantiated(library, pattern, group) == GPU_KERNELS[schema].types, schema
    assert "FLOAT16" in instantiated(library, rb"12EraseImplCpuI" + T, 1)
    assert set(GPU_KERNELS) - set(WITNESSES) == {"decoders__Image", "decoders__ImageRandomCrop", "decoders__ImageSlice",
                                                 "Equalize", "ColorSpaceConversion", "_TensorSubscript",
                                                 "_conditional__Split",
                                                 "_conditional__Merge", "Constant"}


def test_the_decoder_hints_apply_only_to_the_mixed_backend():
    """The evidence DECODER_HINTS rests on, from the installed DALI's schemas: each hint is documented as
    applying only to `mixed` (or as making `mixed` behave like `cpu`), so leaving it out of the cpu graph
    changes nothing there."""
    for schema_name in ("decoders__Image", "decoders__ImageRandomCrop", "decoders__ImageSlice"):
        schema = backend.GetSchema(schema_name)
        assert schema.GetSupportedBackends() == ["cpu", "mixed"]
        for hint in DECODER_HINTS:
            doc = schema.GetArgumentDox(hint)
            assert "only** to the ``mixed`` backend" in doc or "Make the ``mixed`` backend use the same" in doc, hint


# -- finding 1 and 5: the same hints on every mixed decoder ------------------------------------

MIXED = [(name, device) for name, device in CASES if device == "gpu"]


@pytest.mark.parametrize("name,device", MIXED)
def test_every_mixed_decoder_gets_the_hints(graph, name, device):
    """hw_decoder_load, the memory paddings (sized by decoder_memory) and chroma upsampling reach every mixed
    decoder, not only the training one (issue 19, findings 1 and 5)."""
    expected_load = 0.99 if name.endswith("hw_decoder_load_0.99") else {
        "gpu-check-checkpoint-loader": 0.99, "dali-bench-loader": 0.3, "dali-bench-detection-loader": 0.2,
    }.get(name, DEFAULT_HW_DECODER_LOAD)
    memory = decoder_memory(threads=2)
    decoders = [op for op in graph(name, device)[0] if op.device == "mixed"]
    assert decoders
    for op in decoders:
        assert op.args["hw_decoder_load"] == pytest.approx(expected_load), op
        assert op.args["device_memory_padding"] == memory.device_padding, op
        assert op.args["host_memory_padding"] == memory.host_padding, op
        # libjpeg-turbo (the cpu decoder) always upsamples chroma "fancily"; nvJPEG does so on request, except
        # that nvImageCodec 0.9 with nvJPEG < 13.2 then refuses region-of-interest decodes of subsampled JPEGs
        # and hands them to libjpeg-turbo on the CPU (gpu-evidence.md): the ROI decoders keep nvJPEG's upsampling.
        assert op.args["jpeg_fancy_upsampling"] is (op.schema not in ROI_DECODERS), op



@pytest.mark.parametrize("name,device", MIXED)
def test_every_mixed_decoder_keeps_dalis_affine_threads(graph, name, device):
    """gpu-evidence.md (DALI's CPU affinity): the mixed decoders' own threads are pinned by DALI's default
    `affine=True` (image_decoder.h builds its ThreadPool with it; the pool pins each thread to NVML's CPUs of
    the GPU's socket, ANDed with the thread's own mask), and no dalifeed graph sets `affine`."""
    for schema_name in ("decoders__Image", "decoders__ImageRandomCrop", "decoders__ImageSlice"):
        schema = backend.GetSchema(schema_name)
        assert schema.GetArgumentDefaultValueString("affine") == "True", schema_name
        assert "tied to a specific CPU core" in schema.GetArgumentDox("affine"), schema_name
    decoders = [op for op in graph(name, device)[0] if op.device == "mixed"]
    assert decoders and all(op.args.get("affine", True) is True for op in decoders), decoders

def installed_nvjpeg_version(cuda_major: int) -> tuple[int, int, int] | None:
    """nvjpegGetProperty of the libnvjpeg.so.<cuda_major> nvImageCodec of that CUDA major loads (a host call: no
    GPU needed), or None where that wheel is not installed. CUDA 12's nvidia-nvjpeg-cu12 puts it in
    nvidia/nvjpeg/lib, CUDA 13's nvidia-nvjpeg in nvidia/cu13/lib (a venv moved from one stack to the other
    can hold both)."""
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    folders = spec.submodule_search_locations if spec else []
    libs = [lib for folder in folders for sub in ("nvjpeg/lib", "cu13/lib")
            for lib in Path(folder).glob(f"{sub}/libnvjpeg.so.{cuda_major}*")]
    if not libs:
        return None
    nvjpeg, value = ctypes.CDLL(str(libs[0])), ctypes.c_int()
    version = []
    for prop in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        nvjpeg.nvjpegGetProperty(prop, ctypes.byref(value))
        version.append(value.value)
    return tuple(version)


def test_region_decoders_keep_nvjpegs_upsampling_while_nvjpeg_refuses_them_fancy():
    """nvImageCodec 0.9 refuses a region decode of a 4:2:0 JPEG with fancy upsampling unless nvJPEG is 13.2 or
    later (gpu-evidence.md), so decoder_hints leaves it off for image_random_crop and image_slice. The CUDA 12 stack's
    nvJPEG (12.x) always refuses; the CUDA 13 stack's (nvidia-nvjpeg 13.3) would take them, but one graph serves
    both stacks, so they stay off there too (gpu-evidence.md). Fails when nvImageCodec leaves 0.9, whose binary the
    rule was read from."""
    from dalifeed.stack import probe

    (major,) = probe().dali_majors
    version = installed_nvjpeg_version(major)
    if version is None:
        pytest.skip("no nvidia-nvjpeg wheel here")
    assert backend.GetNvimgcodecVersion() // 100 == 9  # 0.9.x: the rule below is read from its libnvjpeg_ext
    assert version[0] == major  # the nvJPEG nvImageCodec of this major loads: 12.x refuses, 13.3 would not


def test_the_cpu_decoder_upsamples_chroma_as_libjpeg_does():
    """What jpeg_fancy_upsampling=True makes nvJPEG match: DALI's cpu decoder (nvImageCodec's libjpeg-turbo
    extension, fancy upsampling on by default) decodes a 4:2:0 JPEG with sharp chroma edges as PIL's
    libjpeg-turbo does by default. Box-upsampled chroma differs from it by up to 28 levels on this image."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:64, 0:64]
    stripes = np.stack([np.where((x // 3) % 2, 230, 20), np.full_like(x, 120), np.where((y // 5) % 2, 40, 210)], -1)
    buf = io.BytesIO()
    Image.fromarray(stripes.astype(np.uint8)).save(buf, "JPEG", quality=95, subsampling=2)  # 2 = 4:2:0
    decoder = DaliDecoder("cpu", batch_size=1, num_threads=1).pipeline()
    decoder.build()
    decoder.feed_input("encoded", [np.frombuffer(buf.getvalue(), np.uint8)])
    dali = np.asarray(decoder.run()[0].at(0)).astype(int)
    pil = np.asarray(Image.open(buf).convert("RGB")).astype(int)
    assert np.abs(dali - pil).max() <= 1


def test_decoder_memory_is_bounded_and_adds_up():
    """At most 64 MiB of device and of pinned memory per decoder thread, whatever the image size; a mixed
    decoder reserves threads x (device padding) of GPU and threads x 2 x (host padding) of pinned memory."""
    mib = 2**20
    huge = decoder_memory(threads=16, max_image_side=20000)
    assert huge.device_padding == huge.host_padding == 64 * mib
    memory = decoder_memory(threads=16)
    assert 0 < memory.device_padding <= 64 * mib and 0 < memory.host_padding <= 64 * mib
    assert memory.device_bytes == 16 * memory.device_padding
    assert memory.pinned_bytes == 16 * 2 * memory.host_padding
    small = decoder_memory(threads=16, max_image_side=500)
    assert small.device_padding < memory.device_padding and small.host_padding < memory.host_padding
    # DALI's old ResNet-50 numbers, for ImageNet's largest image (5980 x 6430), were 201 MiB + 2 x 134 MiB
    assert memory.device_padding + 2 * memory.host_padding < (211025920 + 2 * 140544512) / 4


# -- what DALI does here, and that the checks catch what they are for ---------------------------

@pytest.mark.skipif(dali_sees_gpu(), reason="shows what DALI does without a GPU")
def test_dali_serializes_but_does_not_build_a_gpu_graph_without_cuda():
    pipe = verify_decoder("gpu")
    assert parse_graph(pipe.serialize())[0][-1].device == "mixed"
    with pytest.raises(RuntimeError, match="requires a CUDA-capable GPU"):
        pipe.build()


READER_ARGS = {"paths", "index_paths", "shard_id", "num_shards"}


@pytest.mark.parametrize("name", ["train-ta_wide-random_erase-fp16", "multilabel-train", "detection-train-size",
                                  "gpu-check-checkpoint-loader"])
def test_a_later_epochs_gpu_pipeline_is_the_first_one_with_only_its_reader_re_aimed(graph, name, shards,
                                                                                     mini_coco_shards):
    """On a GPU, the loader makes every epoch after the first from the first pipeline serialized, with the
    reader's arguments replaced and the origin traces left out (serialized.py; tests/test_serialized.py runs
    it on the CPU). Here, without a GPU: the GPU graph so made has every operator, edge, device and argument
    of the defined one but those."""
    defined = GRAPHS[name][0](shards, mini_coco_shards)("gpu").serialize()
    tars = [f"/data/epoch-order-{i}.tar" for i in range(3)]
    made = with_reader_arguments(without_origins(defined), paths=tars, index_paths=[t + ".idx" for t in tars],
                                 shard_id=3, num_shards=8)
    (before, outputs_before), (after, outputs_after) = parse_graph(defined), parse_graph(made)
    assert outputs_after == outputs_before
    assert [(op.schema, op.name, op.device, op.inputs, op.outputs) for op in after] == \
        [(op.schema, op.name, op.device, op.inputs, op.outputs) for op in before]
    assert any(op.device != "cpu" for op in after)
    for old, new in zip(before, after):
        kept = {k: v for k, v in old.args.items() if not k.startswith("_origin_stack_")}
        if old.schema == "readers__Webdataset":
            assert {k: new.args[k] for k in READER_ARGS} == {
                "paths": tuple(tars), "index_paths": tuple(t + ".idx" for t in tars), "shard_id": 3, "num_shards": 8}
            kept = {k: v for k, v in kept.items() if k not in READER_ARGS}
            assert {k: v for k, v in new.args.items() if k not in READER_ARGS} == kept
        else:
            assert new.args == kept


def _broken_graphs():
    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def cpu_only_op_on_the_gpu():
        boxes = fn.external_source(name="boxes", dtype=types.FLOAT, ndim=2)
        return tuple(fn.random_bbox_crop(boxes.gpu(), device="gpu", bbox_layout="xyXY"))

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def decoder(device, extra=None):
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(encoded, device=device, output_type=types.RGB, **(extra or {}))

    return cpu_only_op_on_the_gpu, decoder


def test_the_checks_catch_what_serializing_lets_through():
    """A CPU-only operator put on the GPU, a deprecated argument and an argument the cpu graph lacks all
    serialize without complaint; the checks name each."""
    cpu_only_op_on_the_gpu, decoder = _broken_graphs()
    ops_, _ = parse_graph(cpu_only_op_on_the_gpu().serialize())
    assert [line for line in backend_problems(ops_) if "RandomBBoxCrop" in line]
    with pytest.warns(Warning, match="split_stages"):
        deprecated = parse_graph(decoder("mixed", {"split_stages": True}).serialize())
    assert any("split_stages" in line for line in schema_problems(deprecated[0]))
    cpu = parse_graph(decoder("cpu").serialize())
    assert difference_problems(cpu, parse_graph(decoder("mixed", {"jpeg_fancy_upsampling": True}).serialize())) == []
    assert any("use_fast_idct" in line
               for line in difference_problems(cpu, parse_graph(decoder("mixed", {"use_fast_idct": True}).serialize())))
    with pytest.raises(KeyError, match="made_up_kwarg"):  # an unknown argument fails when the graph is defined
        decoder("mixed", {"made_up_kwarg": 1}).serialize()
