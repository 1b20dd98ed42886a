"""The closed-form communication costs of the p-FeSTA paper (Park et al., "Multi-Task Distributed
Learning using Vision Transformer with Random Patch Permutation", Table V), reported beside the
bytes `veil.federated.comm.Ledger` measures on the wire.

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
