"""Secure aggregation for `veil federate`: Flower's SecAgg+ under veil's round loop, alone or with
Flower's client-side DP (the `fl-dp-sa` combination), and the live auditor on what is left.

Protocol (SecAgg+: Bell et al., CCS 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", on SecAgg: Bonawitz et al., CCS 2017). Each sampled client i scales
its reply x_i (the weights after local training, or the gradient in fedsgd) by its weight
r_i = n_i / max_weight, clips it to [-c, c] (c = ``clipping_range``), quantizes it by stochastic
rounding to integers in [0, q) (q = ``quantization_range``), and adds a private mask PRG(b_i) and
pairwise masks +-PRG(s_ij) shared with its neighbours in a ring of ``num_shares`` nodes, modulo
``modulus_range``. The server sums the masked vectors; the pairwise masks cancel, the private masks
are removed from ``reconstruction_threshold`` Shamir shares of b_i, and what is left is
sum_i Q(r_i x_i), dequantized and divided by sum_i r_i: the weighted mean of FedAvg. The server
never holds any x_i, only the sum.

The stated error against plain FedAvg: with every |r_i x_i| <= c, each client adds at most one
quantization step d = 2c / q per entry (stochastic rounding, unbiased), so per entry

    |SecAgg+ mean - FedAvg mean| <= N d / sum_i r_i        (`error_bound`)

plus the rounding of each r_i to a multiple of 1/q (relative error <= 1/(2 q r_i)).

Flower 1.42 implements SecAgg+ only as a workflow over the legacy `flwr.server.strategy`
interface (`SecAggPlusWorkflow` needs a `LegacyContext` with `configure_fit` / `aggregate_fit`)
and the legacy `FitIns` / `FitRes` records on the client (`secaggplus_mod`). veil's round loop is
the Message API, so this module drives the four stages of Flower's `SecAggPlusWorkflow`
(setup, share keys, collect masked vectors, unmask: Flower's own code) with a legacy-shaped
`_Round` that samples veil's nodes and receives the aggregate, and on the client `secure_mod`
runs Flower's `secaggplus_mod` around a bridge that hands veil's train handler its usual
{"arrays", "config"} message and turns the reply into a `FitRes`. Under ``federated.dp:
client-fixed`` the round object sits inside Flower's legacy `DifferentialPrivacyClientSideFixedClipping`
(the `fl-dp-sa` example's composition): the clients clip their update (Flower's
`fixedclipping_mod`, under the SecAgg+ masking), the server adds N(0, (z C / k)^2) to the
aggregate. ``local`` DP noises each update before it is masked. Server-side clipping cannot
run: the server never sees an update to clip.

What the auditor gets under SecAgg+: the pre-noise aggregate the server unmasked, attacked as one
batch of every sampled client's samples (`veil.federated.fedavg.aggregate_audit`), and the
clients' train metrics (loss, steps, partition id, examples), which SecAgg+ leaves in the clear.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp import Grid

from veil.errors import VeilError
from veil.federated.comm import message_bytes

#: veil's SecAgg+ options and their defaults: Flower's `SecAggPlusWorkflow` defaults for the
#: ranges and the weight cap; Flower has none for the shares and the threshold, veil takes those of
#: Flower's secure-aggregation example (3 shares, any 2 of them rebuild a key)
DEFAULTS: dict[str, float | int] = {
    "num_shares": 3,  # nodes in each client's ring (int > 2), or a fraction of the sampled clients (float)
    "reconstruction_threshold": 2,  # shares that rebuild a key (int < num_shares), or a fraction of num_shares
    "clipping_range": 8.0,  # |entry| clipped to this before quantization
    "quantization_range": 4194304,  # 2**22 integer levels over [-clipping_range, clipping_range]
    "modulus_range": 4294967296,  # 2**32: the masks' ring
    "max_weight": 1000.0,  # a client's weight r_i = examples / max_weight
}
NAMES_KEY = "secagg-names"  # the reply's tensor names, in order (public: the model's own names)
DP_KINDS = ("none", "client-fixed", "local")


def check_secagg(fed: Any) -> None:
    """Resolve ``federated.secagg`` (None: off; true or a mapping: on) to the full option dict;
    one-line errors for a bad key, value or combination (called by `federated_config`)."""
    raw = fed.secagg
    if raw is None or raw is False:
        fed.secagg = None
        return
    if raw is True:
        raw = {}
    if not isinstance(raw, dict):
        raise VeilError(f"federated.secagg must be a mapping of SecAgg+ options (or true), got {raw!r}")
    odd = sorted(set(raw) - set(DEFAULTS))
    if odd:
        raise VeilError(f"federated.secagg has no option '{odd[0]}'; allowed: {', '.join(DEFAULTS)}")
    opts = {**DEFAULTS, **raw}
    for k, v in opts.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise VeilError(f"federated.secagg.{k} must be a positive number, got {v!r}")
    for k in ("quantization_range", "modulus_range"):
        if not isinstance(opts[k], int):
            raise VeilError(f"federated.secagg.{k} must be an integer, got {opts[k]!r}")
    try:
        SecAggPlusWorkflow(**_workflow_kwargs(opts))
    except (TypeError, ValueError) as e:
        raise VeilError(f"federated.secagg: {e}") from None
    from veil.federated.fedavg.dp import sampled_clients

    if sampled_clients(fed.clients, fed.fraction) < 2:
        raise VeilError(
            "federated.secagg needs at least 2 clients per round (Flower's SecAgg+ refuses one: the sum would be the update)"
        )
    if fed.dp not in DP_KINDS:
        raise VeilError(
            f"federated.secagg runs with federated.dp {', '.join(DP_KINDS)}; {fed.dp} clips on the server, "
            "which never sees an update under SecAgg+"
        )
    fed.secagg = opts


def _workflow_kwargs(opts: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
    return {**opts, "timeout": timeout}


def error_bound(opts: dict[str, Any], weights: Iterable[float]) -> float:
    """Largest per-entry difference between SecAgg+'s mean and FedAvg's over clients with example
    counts `weights` (module docstring), for entries within the clipping range."""
    w = [float(n) / float(opts["max_weight"]) for n in weights]
    step = 2.0 * float(opts["clipping_range"]) / float(opts["quantization_range"])
    return len(w) * step / sum(w)


def error_std(opts: dict[str, Any], weights: Iterable[float]) -> float:
    """Standard deviation bound of SecAgg+'s per-entry error on the mean: each client's stochastic
    rounding error has variance <= d^2 / 4 (d = 2c / q) and zero mean, independently, so the mean's
    error has std <= sqrt(N) d / (2 sum_i r_i)."""
    w = [float(n) / float(opts["max_weight"]) for n in weights]
    step = 2.0 * float(opts["clipping_range"]) / float(opts["quantization_range"])
    return len(w) ** 0.5 * step / 2.0 / sum(w)


# ---- server ------------------------------------------------------------------------------------
class _Node(ClientProxy):
    """A sampled node as the legacy workflow names it (only `node_id` is read)."""

    def __init__(self, node_id: int) -> None:
        super().__init__(str(node_id))
        self.node_id = node_id

    def get_properties(self, *a: Any, **k: Any) -> Any:
        raise NotImplementedError

    def get_parameters(self, *a: Any, **k: Any) -> Any:
        raise NotImplementedError

    def fit(self, *a: Any, **k: Any) -> Any:
        raise NotImplementedError

    def evaluate(self, *a: Any, **k: Any) -> Any:
        raise NotImplementedError

    def reconnect(self, *a: Any, **k: Any) -> Any:
        raise NotImplementedError


class _Round:
    """The legacy strategy the SecAgg+ stages call: `configure_fit` hands out veil's train config
    to the sampled nodes, `aggregate_fit` receives the unmasked weighted mean (each result carries
    that same aggregate and the client's clear-text metrics) and keeps it."""

    def __init__(self, nodes: list[int], config: dict[str, Any]) -> None:
        self.nodes, self.config = nodes, config
        self.aggregate: list[np.ndarray] | None = None
        self.metrics: list[tuple[int, dict[str, Any]]] = []  # (examples, metrics) per client

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list[tuple]:
        return [(_Node(n), FitIns(parameters, dict(self.config))) for n in self.nodes]

    def aggregate_fit(self, server_round: int, results: list[tuple], failures: list[Any]) -> tuple:
        if not results:
            return None, {}
        self.aggregate = parameters_to_ndarrays(results[0][1].parameters)
        self.metrics = [(int(r.num_examples), dict(r.metrics)) for _, r in results]
        return results[0][1].parameters, {}

    # the rest of the legacy interface: unused by the stages
    def initialize_parameters(self, client_manager: Any) -> None:
        return None

    def configure_evaluate(self, *a: Any) -> list:
        return []

    def aggregate_evaluate(self, *a: Any) -> tuple:
        return None, {}

    def evaluate(self, *a: Any) -> None:
        return None


class _NodeCount:
    def __init__(self, n: int) -> None:
        self.n = n

    def num_available(self) -> int:
        return self.n


class _History:
    def add_metrics_distributed_fit(self, **k: Any) -> None:
        return None


@dataclass
class _Context:
    """What the four SecAgg+ stages read of a `LegacyContext`."""

    state: RecordDict
    strategy: Any
    client_manager: _NodeCount
    history: _History


class _Counted(Grid):
    """A Grid view that counts the bytes of every message the SecAgg+ stages send and receive."""

    def __init__(self, grid: Grid) -> None:
        self._grid, self.down, self.up = grid, 0, 0

    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *a: Any, **k: Any) -> Message:
        return self._grid.create_message(*a, **k)

    def get_node_ids(self) -> list[int]:
        return list(self._grid.get_node_ids())

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        msgs = list(messages)
        self.down += sum(message_bytes(m) for m in msgs)
        replies = list(self._grid.send_and_receive(msgs, timeout=timeout))
        self.up += sum(message_bytes(m) for m in replies)
        return replies


@dataclass
class SecureRound:
    """One SecAgg+ round as the server saw it."""

    released: ArrayRecord | None  # what the server applies (with central DP: the noised aggregate)
    aggregate: dict[str, torch.Tensor] | None  # the unmasked weighted mean before any server noise
    clients: list[tuple[int, dict[str, Any]]]  # (examples, clear-text train metrics) per client that took part
    sampled: int
    down: int
    up: int


def secure_round(
    grid: Grid, fed: Any, nodes: list[int], rnd: int, names: list[str], arrays: ArrayRecord, config: dict[str, Any]
) -> SecureRound:
    """Run Flower's four SecAgg+ stages for round `rnd` over `nodes`, sending `arrays` (named
    `names`, in order) and `config`; the aggregate comes back named the same."""
    opts = fed.secagg
    inner = _Round(nodes, {**config, NAMES_KEY: json.dumps(names)})
    strategy: Any = inner
    if fed.dp == "client-fixed":
        strategy = DifferentialPrivacyClientSideFixedClipping(inner, fed.dp_noise, fed.dp_clip, len(nodes))
    state = RecordDict(
        {
            MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd}),
            MAIN_PARAMS_RECORD: ArrayRecord([a.numpy() for a in arrays.to_torch_state_dict().values()]),
        }
    )
    ctx = _Context(state, strategy, _NodeCount(len(nodes)), _History())
    workflow = SecAggPlusWorkflow(**_workflow_kwargs(opts, fed.timeout))
    counted = _Counted(grid)
    wf = WorkflowState()
    stages = (
        workflow.setup_stage,
        workflow.share_keys_stage,
        workflow.collect_masked_vectors_stage,
        workflow.unmask_stage,
    )
    ok = all(stage(counted, ctx, wf) for stage in stages)  # type: ignore[arg-type]  # stops at the first that halts
    like = arrays.to_torch_state_dict()
    if not ok or inner.aggregate is None:
        return SecureRound(None, None, inner.metrics, len(nodes), counted.down, counted.up)
    clean = {n: torch.from_numpy(np.asarray(a)).to(like[n].dtype) for n, a in zip(names, inner.aggregate, strict=True)}
    released = clean
    if fed.dp == "client-fixed":
        if len(inner.metrics) < len(nodes):  # a round that lost a client releases nothing (as veil's DP rounds)
            released = None
        else:
            noised = ctx.state.array_records[MAIN_PARAMS_RECORD].to_numpy_ndarrays()
            released = {
                n: torch.from_numpy(np.asarray(a)).to(like[n].dtype) for n, a in zip(names, noised, strict=True)
            }
    rec = None if released is None else ArrayRecord({k: v.contiguous() for k, v in released.items()})
    return SecureRound(rec, clean, inner.metrics, len(nodes), counted.down, counted.up)


# ---- client ------------------------------------------------------------------------------------
def secure_mod(msg: Message, ctx: Context, call_next: ClientAppCallable) -> Message:
    """The client's outer train mod: a SecAgg+ stage message goes through Flower's `secaggplus_mod`
    (which masks what the train handler returns); any other message passes through."""
    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, ctx)
    return secaggplus_mod(msg, ctx, _bridge(call_next))


def _bridge(call_next: ClientAppCallable) -> Callable[[Message, Context], Message]:
    """Legacy `FitIns` in, veil's {"arrays", "config"} to the train handler, its reply as a `FitRes`."""

    def handle(msg: Message, ctx: Context) -> Message:
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        config = dict(fitins.config)
        names = json.loads(str(config.pop(NAMES_KEY)))
        arrays = ArrayRecord(
            {n: Array(a) for n, a in zip(names, parameters_to_ndarrays(fitins.parameters), strict=True)}
        )
        inner = Message(content=RecordDict({"arrays": arrays, "config": ConfigRecord(config)}), metadata=msg.metadata)
        reply = call_next(inner, ctx)
        if reply.has_error():
            return reply
        out = reply.content["arrays"]
        metrics = {k: v for k, v in reply.content["metrics"].items()}
        weight = int(metrics.get("dp-weight", metrics["num-examples"]))  # uniform under DP, as veil's DP rounds
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(out.to_numpy_ndarrays()), weight, metrics)
        content = compat.fitres_to_recorddict(fitres, keep_input=True)
        content[NAMES_KEY] = ConfigRecord({"names": list(out.keys())})
        if "receipt" in reply.content:
            content["receipt"] = reply.content["receipt"]
        return Message(content, reply_to=msg)

    return handle


def train_metrics(clients: list[tuple[int, dict[str, Any]]]) -> MetricRecord | None:
    """The round's train metrics from the clients' clear-text ones: the examples-weighted mean loss."""
    if not clients:
        return None
    n = sum(max(1, int(m.get("num-examples", w))) for w, m in clients)
    loss = sum(float(m.get("loss", 0.0)) * max(1, int(m.get("num-examples", w))) for w, m in clients) / n
    return MetricRecord({"loss": loss, "num-examples": n})
