"""Cut a shipped image set into per-silo image folders, for a trial federation on one machine.

    python scripts/deploy/make_silos.py OUT --config configs/fedavg_digits.yaml --clients 3

writes OUT/silo0, OUT/silo1, ... (one sub-folder per class, PNG files): the partitions the same
config gets in simulation (`veil.federated.fedavg.task.partitions`), so a deployment on these
folders and a `veil federate` run train on the same images (8-bit PNG rounding aside). Each
SuperNode is then pointed at its folder with `--node-config 'partition-id=i data-path="OUT/silo<i>"'`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from veil.build import build_data
from veil.federated.fedavg.task import load_spec, partitions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--config", default="configs/fedavg_digits.yaml")
    p.add_argument("--clients", type=int, default=3)
    a = p.parse_args()
    spec = load_spec(a.config, [f"federated.clients={a.clients}"])
    data = build_data(spec.cfg)
    px, labels = data.train["pixels"], np.asarray(data.train["labels"])
    for pid, idx in enumerate(partitions(data, spec.fed, spec.cfg.train.seed)):
        for i in idx:
            folder = a.out / f"silo{pid}" / data.class_names[int(labels[i])]
            folder.mkdir(parents=True, exist_ok=True)
            img = (px[i].clamp(0, 1).numpy() * 255).round().astype(np.uint8)
            Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)).save(folder / f"{i:05d}.png")
        print(f"silo{pid}: {len(idx)} images", flush=True)


if __name__ == "__main__":
    main()
