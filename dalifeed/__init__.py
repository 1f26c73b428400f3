"""dalifeed: WebDataset shards -> NVIDIA DALI pipelines -> PyTorch trainer, to keep GPUs fed."""

__version__ = "0.1.0"
