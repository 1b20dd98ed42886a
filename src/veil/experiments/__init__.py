"""Experiment plumbing: build a run from a config, scenario runner, sweeps."""
