"""Benchmarks behind ``fivefold bench``."""
