"""Cut a shipped image set into per-silo image folders, for a trial federation on one machine.

    python scripts/deploy/make_silos.py OUT --config configs/fedavg_deploy_digits.yaml

writes OUT/silo0, OUT/silo1, ... (one sub-folder per class, PNG files): the partitions the same
config gets in simulation (`veil.federated.fedavg.task.partitions`), so a deployment on these
folders and a `veil federate` run train on the same images (8-bit PNG rounding aside). Each
SuperNode is then pointed at its folder with `--node-config 'partition-id=i data-path="OUT/silo<i>"'`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from veil.build import build_data
from veil.federated.fedavg.silo import export_silos
from veil.federated.fedavg.task import load_spec, partitions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--config", default="configs/fedavg_deploy_digits.yaml")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. federated.clients=5")
    a = p.parse_intermixed_args()
    spec = load_spec(a.config, a.overrides)
    data = build_data(spec.cfg)
    for folder in export_silos(data, partitions(data, spec.fed, spec.cfg.train.seed), a.out):
        print(folder, flush=True)


if __name__ == "__main__":
    main()
