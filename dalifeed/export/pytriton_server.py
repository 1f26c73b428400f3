"""An export served by PyTriton (NVIDIA's Triton server inside a Python wheel, with its Python backend): the
`LocalRepository` of a folder `dalifeed export --device cpu` wrote, behind one model named as the export's
ensemble, with dynamic batching. Run in its own environment (PyTriton 0.7 pins numpy < 2):

    python -m dalifeed.export.pytriton_server REPO [--http-port 8000 --grpc-port 8001]

The model takes `IMAGE`, one encoded image per sample as bytes (Triton's TYPE_STRING: a batch of images of
different lengths, which a UINT8 [-1] input cannot batch without ragged batching), and answers `LOGITS`.
Imports DALI, numpy, onnxruntime and pytriton, not torch."""

from __future__ import annotations

import argparse

import numpy as np

from . import triton
from .local import LocalRepository


def serve(repo: str, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002) -> None:
    """Serve the export in `repo` until interrupted."""
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    local = LocalRepository(repo)

    @batch
    def infer(**inputs):
        encoded = [bytes(sample[0]) for sample in inputs[triton.ENSEMBLE_INPUT]]
        return {triton.ENSEMBLE_OUTPUT: local(encoded)}

    config = TritonConfig(http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)
    with Triton(config=config) as server:
        server.bind(model_name=local.record["models"]["ensemble"], infer_func=infer,
                    inputs=[Tensor(name=triton.ENSEMBLE_INPUT, dtype=np.bytes_, shape=(1,))],
                    outputs=[Tensor(name=triton.ENSEMBLE_OUTPUT, dtype=np.float32, shape=(-1,))],
                    config=ModelConfig(max_batch_size=local.batch_size, batcher=DynamicBatcher()))
        server.serve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo", help="a folder `dalifeed export --device cpu` wrote")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    args = parser.parse_args()
    serve(args.repo, args.http_port, args.grpc_port, args.metrics_port)


if __name__ == "__main__":
    main()
