"""Analyses of trained runs (e.g. `veil.analysis.pe`: PCA of the position-embedding table)."""
