"""Lever 4 for one-pass models: dynamic batching with length buckets (see batcher.py)."""
