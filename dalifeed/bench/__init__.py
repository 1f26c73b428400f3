"""dali-bench: the pipelines against a tuned torch DataLoader; and shard-convert's rate against bare decode.

The library: `config.BenchConfig` (dali-bench's options, checked), `run.run_bench` (the race), `loaders` and
`detection` (what races), `measure` and `sampler` (timing, CPU, memory, GPU), `report` (table and plot).
The commands over it: `cli` (dali-bench), `gpu_check` (make gpu-check; `gpu_report` renders it),
`make_bench` (make bench, on `photos`), `convert_rate`, `coco_rate`, `stages`, `val_vs_torchvision`.
"""
