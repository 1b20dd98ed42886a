"""The dataset registry: loaders register here by name, `load_data` builds from it."""

from __future__ import annotations

from veil.data.splits import DataSplits
from veil.registry import Registry

DATASETS: Registry[DataSplits] = Registry("dataset")
