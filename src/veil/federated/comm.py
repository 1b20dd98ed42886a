"""Communication accounting: the bytes each Flower message actually occupies on the wire (its
protobuf serialisation), tallied per protocol and per message type, beside the closed-form costs
of the p-FeSTA paper (Park et al., "Multi-Task Distributed Learning using Vision Transformer with
Random Patch Permutation", Table V).

Paper's per-client cost over R rounds, with D local samples, batch B, aggregation every n rounds,
F / G the bytes of one sample's features / gradients, P_h / P_b / P_t the bytes of the head / body /
tail parameters (the factor 2 counts both directions):

    FL:       T = 2 (P_h + P_b + P_t) R / n
    SL:       T = 2 (F + G) D R                       (features up and gradients down, per sample)
    FeSTA:    T = 2 (F + G) D R + 2 (P_h + P_t) R / n
    p-FeSTA:  T = (F + G) D R + F D + 2 P_t R / n     (head features sent once; the body's
                                                       output features down and their gradients up;
                                                       the cached head features need no gradient)

Here a "round" is one pass over the client's D samples, as in the paper.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message, RecordDict
from flwr.common.serde import message_to_proto, recorddict_to_proto


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


def paper_cost(protocol: str, D: int, R: int, n: float, F: int, G: int, P_h: int, P_b: int, P_t: int) -> float:
    """The paper's communication cost of one client (bytes), see the module docstring."""
    if protocol == "fl":
        return 2 * (P_h + P_b + P_t) * R / n
    if protocol == "sl":
        return 2 * (F + G) * D * R
    if protocol == "festa":
        return 2 * (F + G) * D * R + 2 * (P_h + P_t) * R / n
    if protocol == "pfesta":
        return (F + G) * D * R + F * D + 2 * P_t * R / n
    raise ValueError(f"unknown protocol {protocol!r}")
