"""Lever 1, structure: pruning (unstructured and structured) and knowledge distillation."""
