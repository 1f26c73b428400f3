"""The text of a Triton model repository: each model's config.pbtxt (Triton's `ModelConfig` protobuf in text
format) and the README that says how to serve it. Names and shapes come from `Tensors`, the one place the three
models' inputs and outputs are named, so that the ensemble's wiring and the models agree by construction."""

from __future__ import annotations

from dataclasses import dataclass

# The DALI backend feeds each request's input to the `fn.external_source` of the same name.
DALI_INPUT = "DALI_INPUT_0"
# The DALI backend matches a pipeline's outputs to the config's outputs in order; pipelines have no output names.
DALI_OUTPUT = "DALI_OUTPUT_0"
ONNX_INPUT, ONNX_OUTPUT = "images", "logits"
ENSEMBLE_INPUT, ENSEMBLE_OUTPUT = "IMAGE", "LOGITS"
PREPROCESSED = "preprocessed"  # the ensemble's name for the tensor between its two steps
LABELS = "labels.txt"


@dataclass(frozen=True)
class Tensors:
    """The repository's models and the shapes between them.

    Attributes:
        name: The ensemble's name, what clients call; the models are `{name}_preprocess` and `{name}_onnx`.
        size: The side of the square images the DALI model hands out and the classifier takes.
        classes: The number of classes, the classifier's logits per image.
        max_batch_size: Triton's largest batch for each model.
        gpu: Whether the models run on the GPU (KIND_GPU) or the CPU (KIND_CPU).
    """

    name: str
    size: int
    classes: int
    max_batch_size: int
    gpu: bool

    @property
    def preprocess(self) -> str:
        return f"{self.name}_preprocess"

    @property
    def classifier(self) -> str:
        return f"{self.name}_onnx"

    @property
    def image_dims(self) -> list[int]:
        return [3, self.size, self.size]


def _tensor(name: str, dtype: str, dims: list[int], label_filename: str | None = None, ragged: bool = False) -> str:
    label = f' label_filename: "{label_filename}"' if label_filename else ""
    label += " allow_ragged_batch: true" if ragged else ""
    return f'  {{ name: "{name}" data_type: {dtype} dims: [ {", ".join(map(str, dims))} ]{label} }}'


def _instances(t: Tensors) -> str:
    return f"instance_group [ {{ count: 1 kind: {'KIND_GPU' if t.gpu else 'KIND_CPU'} }} ]\n"


def dali_config(t: Tensors, threads: int) -> str:
    """config.pbtxt of the DALI model: encoded image bytes in, the validation graph's float32 CHW image out, on
    `threads` CPU threads. The input allows ragged batches, as the DALI backend's own configs do, so that the dynamic
    batcher joins requests whose images differ in length (else it joins only those of equal byte counts)."""
    return (f'name: "{t.preprocess}"\nbackend: "dali"\nmax_batch_size: {t.max_batch_size}\n'
            f"input [\n{_tensor(DALI_INPUT, 'TYPE_UINT8', [-1], ragged=True)}\n]\n"
            f"output [\n{_tensor(DALI_OUTPUT, 'TYPE_FP32', t.image_dims)}\n]\n"
            f'parameters [ {{ key: "num_threads" value: {{ string_value: "{threads}" }} }} ]\n'
            f"{_instances(t)}dynamic_batching {{ }}\n")


def onnx_config(t: Tensors) -> str:
    """config.pbtxt of the classifier: images in, logits out, the label file for Triton's classification
    extension (a client asking for `class_count` gets "score:index:label")."""
    return (f'name: "{t.classifier}"\nbackend: "onnxruntime"\nmax_batch_size: {t.max_batch_size}\n'
            f"input [\n{_tensor(ONNX_INPUT, 'TYPE_FP32', t.image_dims)}\n]\n"
            f"output [\n{_tensor(ONNX_OUTPUT, 'TYPE_FP32', [t.classes], LABELS)}\n]\n"
            f"{_instances(t)}dynamic_batching {{ }}\n")


def ensemble_config(t: Tensors) -> str:
    """config.pbtxt of the ensemble: bytes -> the DALI model -> the classifier."""
    steps = [(t.preprocess, {DALI_INPUT: ENSEMBLE_INPUT}, {DALI_OUTPUT: PREPROCESSED}),
             (t.classifier, {ONNX_INPUT: PREPROCESSED}, {ONNX_OUTPUT: ENSEMBLE_OUTPUT})]
    text = ",\n".join(
        f'    {{\n      model_name: "{model}"\n      model_version: -1\n'
        + "".join(f'      input_map {{ key: "{k}" value: "{v}" }}\n' for k, v in inputs.items())
        + "".join(f'      output_map {{ key: "{k}" value: "{v}" }}\n' for k, v in outputs.items()) + "    }"
        for model, inputs, outputs in steps)
    return (f'name: "{t.name}"\nplatform: "ensemble"\nmax_batch_size: {t.max_batch_size}\n'
            f"input [\n{_tensor(ENSEMBLE_INPUT, 'TYPE_UINT8', [-1])}\n]\n"
            f"output [\n{_tensor(ENSEMBLE_OUTPUT, 'TYPE_FP32', [t.classes], LABELS)}\n]\n"
            f"ensemble_scheduling {{\n  step [\n{text}\n  ]\n}}\n")


def readme(t: Tensors, *, run: str, weights: str, top1: float | None, dali_version: str, triton: str) -> str:
    """REPO/README.md: what each folder is and the two commands that serve and load-test it."""
    device = "GPU" if t.gpu else "CPU"
    gpus = "--gpus all " if t.gpu else ""
    recorded = f"{top1:.4f}" if top1 is not None else "not recorded"
    return f"""# Triton model repository: {t.name}

Exported by `dalifeed export` from the dali-train run `{run}` ({weights} weights; validation top-1 the run
recorded for them: {recorded}).

| model | what it is |
|---|---|
| `{t.name}/` | the ensemble clients call: `{ENSEMBLE_INPUT}` (encoded image bytes, UINT8 [-1]) -> \
`{ENSEMBLE_OUTPUT}` (FP32 [{t.classes}]) |
| `{t.preprocess}/1/model.dali` | the run's validation preprocessing (decode, resize, centre crop {t.size}, \
normalise), serialized by DALI {dali_version} |
| `{t.classifier}/1/model.onnx` | the classifier, batch dimension dynamic, {t.classes} classes named in `{LABELS}` |

Every model runs on the {device} (`instance_group`), in batches of up to {t.max_batch_size} (`dynamic_batching`).
Send one image per request, `{ENSEMBLE_INPUT}` of shape [1, its byte count]: the DALI model's input allows ragged
batches, so Triton batches requests whose images differ in length. A request of several images needs them of one
length (a tensor is rectangular).

The DALI backend of the container must run DALI {dali_version} or newer (an older one may refuse the pipeline).
Print the DALI version a release carries:

```
docker run --rm nvcr.io/nvidia/tritonserver:{triton}-py3 \\
  find /opt/tritonserver/backends/dali -path '*nvidia/dali/__init__.py' -exec grep -h '^__version__' {{}} +
```

Serve it with NVIDIA's container, from this folder (ports 8000 HTTP, 8001 gRPC, 8002 metrics):

```
docker run --rm {gpus}-p 8000:8000 -p 8001:8001 -p 8002:8002 -v "$PWD":/models \\
  nvcr.io/nvidia/tritonserver:{triton}-py3 tritonserver --model-repository=/models
```

Measure it with `perf_analyzer`, from a folder outside this one (Triton would take any folder here for a model)
that holds one of your JPEGs as `photo.jpg`: it reads an input's bytes from a file named after the input.

```
mkdir -p perf-data && cp photo.jpg perf-data/{ENSEMBLE_INPUT}
docker run --rm --net=host -v "$PWD":/work -w /work nvcr.io/nvidia/tritonserver:{triton}-py3-sdk \\
  perf_analyzer -m {t.name} --input-data perf-data --shape {ENSEMBLE_INPUT}:$(stat -c %s photo.jpg) \\
  -b {min(8, t.max_batch_size)} --concurrency-range 1:4
```
"""
