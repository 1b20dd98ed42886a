"""Moved to `veil.build` (the composition root sits in veil's core); this name stays only until
the last importers outside the core's owners switch to `veil.build`."""

from veil.build import build_data, build_defenses, build_model, build_run, data_derived, load_run  # noqa: F401
