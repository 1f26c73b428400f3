"""dali-bench: the pipelines against a tuned torch DataLoader; and shard-convert's rate against bare decode."""
