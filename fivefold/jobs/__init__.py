"""The jobs: a lever applied to a real model, measured against the original in the same run, written
as a directory and a report (``fivefold quantize | prune | distill | fuse``, the demo, the benchmarks)."""
