"""An exported repository run in this process, without Triton: `LocalRepository` deserializes model.dali as DALI's
Triton backend does (the pipeline built with the config's max_batch_size, its own threads and device) and runs
model.onnx with onnxruntime (the backend of the classifier's config.pbtxt). What the tests check an export with
and what `dalifeed.bench.serving_skew` measures. Needs DALI, numpy and onnxruntime only (not torch): what a
serving process has (pytriton_server.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from nvidia.dali import Pipeline

from . import triton
from .config import EXPORT_RECORD


class LocalRepository:
    """The DALI model and the classifier of the export in `repo`, on the CPU.

    Args:
        repo: A folder `dalifeed export --device cpu` wrote (a GPU export's model.dali needs a GPU to build).
        num_threads: The DALI pipeline's threads.
        intra_op_threads: onnxruntime's threads (0: its default, every core).
    """

    def __init__(self, repo: str | Path, num_threads: int = 1, intra_op_threads: int = 0):
        import onnxruntime

        self.repo = Path(repo)
        self.record = json.loads((self.repo / EXPORT_RECORD).read_text())
        models = self.record["models"]
        self.batch_size = self.record["config"]["max_batch_size"]
        self.pipe = Pipeline.deserialize(filename=str(self.repo / models["dali"] / "1" / "model.dali"),
                                         batch_size=self.batch_size, num_threads=num_threads, device_id=None)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        self.session = onnxruntime.InferenceSession(str(self.repo / models["onnx"] / "1" / "model.onnx"), options,
                                                    providers=["CPUExecutionProvider"])

    def preprocess(self, encoded: list[bytes]) -> np.ndarray:
        """The DALI model's output for a batch of encoded images (at most max_batch_size): (N, 3, H, W) float32."""
        self.pipe.feed_input(triton.DALI_INPUT, [np.frombuffer(data, dtype=np.uint8) for data in encoded])
        (images,) = self.pipe.run()
        return np.array(images.as_tensor())

    def classify(self, images: np.ndarray) -> np.ndarray:
        """The classifier's logits for a batch of preprocessed images: (N, classes) float32."""
        return self.session.run([triton.ONNX_OUTPUT], {triton.ONNX_INPUT: images})[0]

    def __call__(self, encoded: list[bytes]) -> np.ndarray:
        """The ensemble: encoded images -> logits."""
        return self.classify(self.preprocess(encoded))


def split_images(shards: str | Path, split: str) -> Iterator[tuple[str, bytes, int]]:
    """(key, encoded image, label) of every sample of `split` of an ImageFolder shard folder, in the order the
    validation loader reads them (shard order, then tar order)."""
    from dalifeed.format import CLASS_I64_MEMBER, IMAGE_MEMBER, ShardManifest
    from dalifeed.shardfolder import read_samples

    for sample in read_samples(ShardManifest.load(shards), split, {IMAGE_MEMBER, CLASS_I64_MEMBER}):
        yield sample["__key__"], sample[IMAGE_MEMBER], int.from_bytes(sample[CLASS_I64_MEMBER], "little", signed=True)
