"""dalifeed export: a Triton model repository from a dali-train run, checked without Triton. The DALI model,
deserialized as DALI's Triton backend does, gives the evaluation loader's tensors bit for bit; onnxruntime gives
torch's logits and the top-1 metrics.jsonl recorded for the exported weights; every config.pbtxt parses as
Triton's ModelConfig and agrees with the others, with the DALI pipeline and with the ONNX graph."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dalifeed.cli import main as dalifeed_cli
from dalifeed.export import ExportConfig, export_repository, load_run_weights
from dalifeed.export.local import LocalRepository, split_images
from dalifeed.pipelines import make_loader
from dalifeed.train import checkpoint
from dalifeed.train.data import loader_options
from dalifeed.train.distributed import Dist
from dalifeed.train.trainer import main as train
from fast_recipe import fast_config

CHUNK = 5  # the batches the DALI model is fed: neither the loader's nor a divisor of the split


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    """3 colour-coded classes, 45 train and 21 val images of 24x20 (resized to 18, cropped to 16)."""
    _, shards = make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                            samples_per_shard=10)
    return shards


@pytest.fixture(scope="module")
def run(shards, tmp_path_factory) -> Path:
    """One epoch on the CPU in fp32 (amp off), with an EMA and an SWA average: every kind of weights."""
    out = tmp_path_factory.mktemp("export") / "run"
    train(fast_config(shards, out, epochs=1, width=8, amp="off", device="cpu", ema=0.9, swa_start=0))
    return out


@pytest.fixture(scope="module")
def repo(run) -> Path:
    """The run exported for the CPU by the command line, its default weights."""
    repo = run.parent / "repo"
    result = CliRunner().invoke(dalifeed_cli, ["export", str(run), str(repo), "--device", "cpu",
                                               "--max-batch-size", str(CHUNK)])
    assert result.exit_code == 0, result.output
    assert "swa weights (swa.pt, epoch 0)" in result.output
    return repo


def val_samples(shards: Path) -> tuple[list[bytes], np.ndarray]:
    samples = list(split_images(shards, "val"))
    return [data for _, data, _ in samples], np.array([label for _, _, label in samples])


def preprocessed(repo: Path, encoded: list[bytes]) -> np.ndarray:
    local = LocalRepository(repo)
    return np.concatenate([local.preprocess(encoded[i:i + CHUNK]) for i in range(0, len(encoded), CHUNK)])


def test_the_dali_model_gives_the_evaluation_loaders_tensors_bit_for_bit(shards, run, repo):
    cfg = load_run_weights(run).config
    _, val = loader_options(cfg, Dist(0, 1, 0, torch.device("cpu")), threads=2)  # dali-train's own
    loader = make_loader(shards, **asdict(val), augment=cfg.val_augment())
    expected = torch.cat([images for images, _ in loader]).numpy()
    labels = torch.cat([labels for _, labels in loader]).numpy()
    encoded, truth = val_samples(shards)
    got = preprocessed(repo, encoded)
    assert got.shape == expected.shape == (21, 3, 16, 16) and got.dtype == expected.dtype == np.float32
    assert np.array_equal(labels, truth)  # the same samples in the same order
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("weights", ["best", "last", "ema", "swa"])
def test_onnxruntime_gives_torchs_logits_and_the_recorded_top1(shards, run, repo, weights, tmp_path):
    target = repo if weights == "swa" else tmp_path / "repo"
    if target != repo:
        export_repository(ExportConfig(run=str(run), repo=str(target), weights=weights, device="cpu",
                                       max_batch_size=CHUNK), log=lambda line: None)
    found = load_run_weights(run, weights)
    record = json.loads((target / "export.json").read_text())
    assert (record["weights"], record["top1"], record["amp"]) == (weights, found.top1, "off")
    encoded, labels = val_samples(shards)
    images = preprocessed(target, encoded)
    logits = LocalRepository(target).classify(images)
    with torch.no_grad():
        reference = found.model()(torch.from_numpy(images)).numpy()
    assert np.abs(logits - reference).max() < 1e-4
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    recorded = {"best": "top1", "last": "top1", "ema": "ema_top1", "swa": "swa_top1"}[weights]
    assert (logits.argmax(1) == labels).mean() == found.top1 == line[recorded]


def parse_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_every_config_parses_as_tritons_model_config_and_they_agree(shards, repo):
    import onnx
    from tritonclient.grpc import model_config_pb2 as pb

    dali, model, ensemble = (parse_config(repo / name / "config.pbtxt")
                             for name in ("classifier_preprocess", "classifier_onnx", "classifier"))
    assert (dali.backend, model.backend, ensemble.platform) == ("dali", "onnxruntime", "ensemble")
    assert dali.max_batch_size == model.max_batch_size == ensemble.max_batch_size == CHUNK
    assert [g.kind for g in (*dali.instance_group, *model.instance_group)] == [pb.ModelInstanceGroup.KIND_CPU] * 2

    def tensors(items):
        return {t.name: (t.data_type, list(t.dims)) for t in items}

    image, logits = (pb.TYPE_FP32, [3, 16, 16]), (pb.TYPE_FP32, [3])
    assert tensors(dali.input) == {"DALI_INPUT_0": (pb.TYPE_UINT8, [-1])}
    # requests of one image each, of different lengths, are batched by the DALI model only with a ragged input
    assert dali.input[0].allow_ragged_batch and not model.input[0].allow_ragged_batch
    assert dali.parameters["num_threads"].string_value == "4"  # --dali-threads, read by the DALI backend
    assert tensors(ensemble.input) == {"IMAGE": (pb.TYPE_UINT8, [-1])}
    assert tensors(dali.output) == {"DALI_OUTPUT_0": image}
    assert tensors(model.input) == {"images": image} and tensors(model.output) == {"logits": logits}
    assert tensors(ensemble.output) == {"LOGITS": logits}
    assert model.output[0].label_filename == ensemble.output[0].label_filename == "labels.txt"
    for folder in ("classifier_onnx", "classifier"):
        assert (repo / folder / "labels.txt").read_text().splitlines() == ["blue", "green", "red"]

    # the ensemble's steps: each model's own input and output names, chained through one tensor
    configs = {"classifier_preprocess": dali, "classifier_onnx": model}
    steps = ensemble.ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["classifier_preprocess", "classifier_onnx"]
    for step in steps:
        config = configs[step.model_name]
        assert set(step.input_map) == set(tensors(config.input)) and set(step.output_map) == set(tensors(config.output))
    assert steps[0].input_map["DALI_INPUT_0"] == "IMAGE" and steps[1].output_map["logits"] == "LOGITS"
    assert steps[0].output_map["DALI_OUTPUT_0"] == steps[1].input_map["images"]

    # the DALI pipeline's output and the ONNX graph's signature are what the configs say
    encoded, _ = val_samples(shards)
    out = LocalRepository(repo).preprocess(encoded[:2])
    assert out.dtype == np.float32 and list(out.shape[1:]) == image[1]
    graph = onnx.load(str(repo / "classifier_onnx" / "1" / "model.onnx")).graph

    def signature(values):
        return {v.name: (v.type.tensor_type.elem_type,
                         [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]) for v in values}

    float32 = onnx.TensorProto.FLOAT
    assert signature(graph.input) == {"images": (float32, ["batch", 3, 16, 16])}
    assert signature(graph.output) == {"logits": (float32, ["batch", 3])}


def test_a_gpu_export_decodes_on_the_gpu_and_asks_for_gpu_instances(run, tmp_path):
    """Serialized without a GPU (no device_id); building it needs one, as Triton's DALI backend has."""
    record = export_repository(ExportConfig(run=str(run), repo=str(tmp_path / "gpu"), weights="best"),
                               log=lambda line: None)
    assert record["config"]["device"] == "gpu"
    serialized = (tmp_path / "gpu" / "classifier_preprocess" / "1" / "model.dali").read_bytes()
    assert b"decoders__Image" in serialized and b"mixed" in serialized
    for name in ("classifier_preprocess", "classifier_onnx"):
        assert "kind: KIND_GPU" in (tmp_path / "gpu" / name / "config.pbtxt").read_text()
    readme = (tmp_path / "gpu" / "README.md").read_text()
    assert "docker run --rm --gpus all" in readme and "tritonserver --model-repository=/models" in readme
    assert "perf_analyzer -m classifier" in readme and "-b 8 " in readme
    assert "tritonserver:26.10-py3 " in readme and "tritonserver:26.10-py3-sdk" in readme


def export_cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(dalifeed_cli, ["export", *map(str, args)])
    return result.exit_code, result.output


def test_usage_errors_are_one_line_and_exit_2(run, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = export_cli(empty, tmp_path / "r1")
    assert code == 2 and "not a dali-train run folder with a checkpoint" in out
    code, out = export_cli(run, tmp_path / "r0", "--triton-release", "latest")
    assert code == 2 and "--triton-release must be a container release such as 26.10, got 'latest'" in out
    only_last = tmp_path / "only-last"
    only_last.mkdir()
    shutil.copy(run / checkpoint.LAST, only_last / checkpoint.LAST)
    code, out = export_cli(only_last, tmp_path / "r2", "--weights", "swa")
    assert code == 2 and "--weights swa" in out and "has no swa.pt (it has last.pt)" in out
    payload = checkpoint.load(run / checkpoint.LAST)
    payload["ema"] = None
    checkpoint.save(only_last / checkpoint.LAST, payload)
    code, out = export_cli(only_last, tmp_path / "r3", "--weights", "ema")
    assert code == 2 and "kept no EMA average" in out
    payload["config"]["task"] = "multilabel"
    checkpoint.save(only_last / checkpoint.LAST, payload)
    code, out = export_cli(only_last, tmp_path / "r4")
    assert code == 2 and "a multilabel run" in out
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    code, out = export_cli(run, foreign)
    assert code == 2 and "holds other files than an earlier export" in out
    assert (foreign / "notes.txt").read_text() == "mine"


def test_an_install_without_onnx_is_told_the_extra_in_one_line(run, tmp_path):
    script = ("import sys; sys.modules['onnx'] = None; from dalifeed.cli import main; "  # onnx not installed
              f"main(['export', {str(run)!r}, {str(tmp_path / 'repo')!r}, '--device', 'cpu'])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 2 and "pip install 'dalifeed[export]'" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "repo").exists()


def test_the_skew_bench_measures_both_paths_and_gives_the_exports_top1(shards, run, tmp_path):
    from dalifeed.bench.serving_skew import markdown, measure

    record = measure(run, shards, "val", [1, 4], repeats=1, threads=1, workdir=tmp_path, log=lambda line: None)
    ours, theirs = record["paths"]
    assert ours["top1"] == load_run_weights(run).top1 == record["recorded_top1"]
    assert all(rate > 0 for path in (ours, theirs) for rate in path["images_per_s"].values())
    assert 0 < record["mean_abs_pixel_difference"] < 0.1  # PIL's and DALI's decoders and resizers differ a little
    table = markdown(record)
    assert "| dalifeed export (DALI + onnxruntime) |" in table and "images/s at batch 4" in table


def test_the_skew_bench_refuses_a_folder_without_a_run_and_bad_batches_in_one_line(tmp_path):
    from dalifeed.bench.serving_skew import main as skew

    result = CliRunner().invoke(skew, ["--run", str(tmp_path)])
    assert result.exit_code == 2 and "not a dali-train run folder with a checkpoint" in result.output
    result = CliRunner().invoke(skew, ["--run", str(tmp_path), "--batches", "8,0"])
    assert result.exit_code == 2 and "batch sizes >= 1" in result.output


def test_the_serving_environment_is_given_dalifeed_alone_on_its_path(tmp_path):
    from dalifeed.export.serve import package_path

    folder = Path(package_path(tmp_path))
    assert [p.name for p in folder.iterdir()] == ["dalifeed"]  # not the site-packages dalifeed may stand in
    script = "import dalifeed.export.triton as t; print(t.__file__)"
    result = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": str(folder)})  # -S: no site-packages, as a foreign Python has
    assert result.returncode == 0 and result.stdout.startswith(str(folder)), result.stderr


SERVE_PYTHON = os.environ.get("DALIFEED_SERVE_PYTHON")  # a Python with nvidia-pytriton, nvidia-dali, onnxruntime

CLIENT = """
import sys
import numpy as np
import tritonclient.grpc as grpc
import tritonclient.http as http
from dalifeed.export.local import split_images

samples = list(split_images(sys.argv[1], "val"))
labels = np.array([label for _, _, label in samples])
for module, port in ((http, sys.argv[2]), (grpc, sys.argv[3])):
    client, found = module.InferenceServerClient(f"127.0.0.1:{port}"), []
    for i in range(0, len(samples), 4):
        data = np.array([[image] for _, image, _ in samples[i:i + 4]], dtype=np.object_)
        image = module.InferInput("IMAGE", list(data.shape), "BYTES")
        image.set_data_from_numpy(data)
        found.append(client.infer("classifier", [image]).as_numpy("LOGITS").argmax(1))
    print(module.__name__, float((np.concatenate(found) == labels).mean()))
"""


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.slow
@pytest.mark.skipif(SERVE_PYTHON is None, reason="DALIFEED_SERVE_PYTHON names no serving environment "
                                                   "(docs/serving.md, 'Serve it without a GPU')")
def test_dalifeed_serve_answers_over_http_and_grpc_with_the_exports_top1(shards, run, tmp_path):
    http_port, grpc_port, metrics_port = free_ports(3)
    checkout = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": checkout}
    with open(tmp_path / "serve.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "dalifeed.cli", "serve", str(run), "--python", SERVE_PYTHON,
                                   "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port",
                                   str(metrics_port), "--max-batch-size", "4"], stdout=log, stderr=subprocess.STDOUT,
                                  env=env)
    try:
        ready = f"http://127.0.0.1:{http_port}/v2/models/classifier/ready"
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if urllib.request.urlopen(ready, timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(1)
        client = subprocess.run([SERVE_PYTHON, "-c", CLIENT, str(shards), str(http_port), str(grpc_port)],
                                capture_output=True, text=True, env=env, timeout=240)
        assert client.returncode == 0, client.stderr[-2000:]
        top1 = load_run_weights(run).top1
        assert client.stdout.split() == ["tritonclient.http", str(top1), "tritonclient.grpc", str(top1)]
    finally:
        server.terminate()
        assert server.wait(timeout=60) is not None
