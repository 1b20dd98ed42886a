"""A silo's own data: what a SuperNode trains on, named by its `--node-config`, never by the server.

    --node-config "partition-id=0 data-path=/srv/silo0/images"      # the silo's image folder
    --node-config "partition-id=1 data-path=/srv/silo1/train.csv"   # or a CSV / TSV / JSONL table
    --node-config "partition-id=2 num-partitions=3"                 # demo: the run's shipped set, cut

`partition-id` is the silo's identity in the federation (the server maps it to whichever node id
the silo has now, so a restarted node gets its silo back) and seeds its batch schedule; with
`data-path` the silo loads that path with veil's loaders (`image_folder`, `table`) and trains on
all of its train split. Without it, the run's data set is cut into `num-partitions` partitions as
in simulation (`veil.federated.fedavg.task.partitions`) — every node then loads the whole set,
which is for demos and tests only.

The model must be the same on every party, so a silo's data is shaped by the server's schema
(`Schema`, sent in each message's config): image side and channels, and the class names; a silo
may hold a subset of the classes (its labels are mapped by name), never a class the run lacks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from veil.data import DataSplits, load_data
from veil.errors import VeilError

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl")


@dataclass(frozen=True)
class Schema:
    """What a silo's data must look like for the run's model (from the server's evaluation set)."""

    modality: str
    classes: tuple[str, ...]
    image_size: int = 0
    channels: int = 0

    def text(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_text(text: str) -> Schema:
        d = json.loads(text)
        return Schema(d["modality"], tuple(d["classes"]), int(d["image_size"]), int(d["channels"]))

    @staticmethod
    def of(data: DataSplits) -> Schema:
        if data.modality == "image":
            px = data.train["pixels"]
            return Schema("image", tuple(data.class_names), int(px.shape[-1]), int(px.shape[1]))
        return Schema("text", tuple(data.class_names))


def node_silo(node_config: dict[str, Any], clients: int) -> tuple[int, str | None]:
    """(partition id, data path or None) from a node's config; a bad entry is one line."""
    if "partition-id" not in node_config:
        raise VeilError("the SuperNode's --node-config needs partition-id=N (its silo's id, 0..clients-1)")
    pid = int(node_config["partition-id"])
    if not 0 <= pid < clients:
        raise VeilError(f"partition-id={pid} is out of range: the run has {clients} clients (0..{clients - 1})")
    path = node_config.get("data-path")
    if path is None:
        n = int(node_config.get("num-partitions", clients))
        if n != clients:
            raise VeilError(f"node has partition {pid} of {n}, but the run has {clients} clients")
        return pid, None
    return pid, str(path)


def load_silo(path: str, schema: Schema, seed: int) -> DataSplits:
    """The silo's data at `path`, shaped and labelled by the run's `schema`."""
    p = Path(path)
    if not p.exists():
        raise VeilError(f"data-path {path!r} does not exist on this SuperNode")
    if schema.modality == "image":
        if not p.is_dir():
            raise VeilError(f"data-path {path!r}: an image run needs a folder with one sub-folder per class")
        data = load_data("image_folder", path=str(p), size=schema.image_size, channels=schema.channels, seed=seed)
    else:
        if p.suffix.lower() not in TABLE_SUFFIXES:
            raise VeilError(f"data-path {path!r}: a text run needs a table file ({', '.join(TABLE_SUFFIXES)})")
        raise VeilError(
            "text silos need the run's tokenizer and vocabulary on every node, which veil does not ship yet; "
            "use partition-id with num-partitions for text runs"
        )
    return relabel(data, schema.classes)


def relabel(data: DataSplits, classes: tuple[str, ...]) -> DataSplits:
    """Map the silo's class names onto the run's class indices (a silo may hold only some classes)."""
    unknown = [c for c in data.class_names if c not in classes]
    if unknown:
        raise VeilError(f"silo class {unknown[0]!r} is not a class of the run; allowed: {', '.join(classes)}")
    lut = torch.tensor([classes.index(c) for c in data.class_names], dtype=torch.long)
    train = {**data.train, "labels": lut[torch.as_tensor(data.train["labels"]).long()]}
    test = {**data.test, "labels": lut[torch.as_tensor(data.test["labels"]).long()]}
    return DataSplits(train, test, len(classes), list(classes), data.modality, {**data.meta, "silo": True})


def silo_parts(n_train: int, pid: int, clients: int) -> list[np.ndarray]:
    """A silo trains on all of its own train split: the index list of its partition id."""
    empty = np.zeros(0, dtype=np.int64)
    return [np.arange(n_train, dtype=np.int64) if i == pid else empty for i in range(clients)]


def export_silos(data: DataSplits, parts: list[np.ndarray], out: Path) -> list[Path]:
    """Write each partition of `data`'s train split as an image folder OUT/silo<i>/<class>/<n>.png:
    per-silo data for a trial federation on one machine (8-bit PNG, so values round to 1/255)."""
    from PIL import Image

    if data.modality != "image":
        raise VeilError("export_silos writes image folders; the data set is text")
    px, labels, folders = data.train["pixels"], np.asarray(data.train["labels"]), []
    for pid, idx in enumerate(parts):
        root = out / f"silo{pid}"
        for i in idx:
            folder = root / data.class_names[int(labels[i])]
            folder.mkdir(parents=True, exist_ok=True)
            img = (px[i].clamp(0, 1).numpy() * 255).round().astype(np.uint8)
            Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)).save(folder / f"{int(i):05d}.png")
        folders.append(root)
    return folders
