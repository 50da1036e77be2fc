"""Lever 2, hardware: the same math with fewer trips to memory (in progress: tiled attention)."""
