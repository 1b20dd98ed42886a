"""Messages on the wire, shared by FedAvg and split learning: the bytes each Flower message
actually occupies (its protobuf serialisation), tallied per message type (`Ledger`), and the
one-tensor records split learning exchanges (`array_of` / `tensor_of`). The paper's closed-form
costs beside them are in `veil.federated.split.comm`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, Message, RecordDict
from flwr.common.serde import message_to_proto, recorddict_to_proto
from torch import Tensor


def message_bytes(msg: Message) -> int:
    """Serialised size of a whole message (content or error, plus metadata)."""
    return int(message_to_proto(msg).ByteSize())


def content_bytes(content: RecordDict) -> int:
    return int(recorddict_to_proto(content).ByteSize())


@dataclass
class Ledger:
    """Bytes sent server -> clients (`down`) and clients -> server (`up`), by message type."""

    down: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    up: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    count: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def sent(self, msg: Message, size: int | None = None) -> int:
        size = message_bytes(msg) if size is None else size
        self.down[msg.metadata.message_type] += size
        self.count[msg.metadata.message_type] += 1
        return size

    def received(self, msg: Message, size: int | None = None) -> int:
        size = message_bytes(msg) if size is None else size
        self.up[msg.metadata.message_type] += size
        return size

    def total(self) -> int:
        return sum(self.down.values()) + sum(self.up.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes_down": sum(self.down.values()),
            "bytes_up": sum(self.up.values()),
            "bytes_total": self.total(),
            "by_type": {
                k: {"down": self.down.get(k, 0), "up": self.up.get(k, 0), "messages": self.count.get(k, 0)}
                for k in sorted(set(self.down) | set(self.up))
            },
        }


def array_of(x: Tensor) -> ArrayRecord:
    """One tensor as a record (detached, contiguous): a message's payload under one key."""
    return ArrayRecord({"x": x.detach().contiguous()})


def tensor_of(msg: Message, key: str) -> Tensor:
    """The tensor `array_of` packed under `key` of a message's content."""
    return msg.content[key].to_torch_state_dict()["x"]
