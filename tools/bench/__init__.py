"""Benchmarks: programs that print and save numbers (never tests). `ttg bench encoder|engine|decoder`."""
