"""Lever 2, hardware: the same math with fewer trips to memory (fx fusion, layout, tiled attention)."""
