"""`veil.flower`: audit the Flower app a team already runs, without rewriting it as a veil config.

A stock Message-API ServerApp (Flower's ``quickstart-pytorch`` shape) adopts it in two lines:

    from veil.flower import audited
    strategy = audited(FedAvg(fraction_train=0.5), model=Net(), attacks=["ig", "labels"], out="veil-audit",
                       input_shape=(3, 32, 32), batch_size=32)

`audited` wraps any `flwr.serverapp.strategy.Strategy`: every call is the wrapped strategy's, and
before `aggregate_train` the honest-but-curious server's attacks run on the updates it received
(every `every`-th round, the first `clients` replies) with the user's own `nn.Module`. Nothing
changes on the client. A Message-API strategy receives every client's reply in the clear, so each
view is one client's update (``server_saw`` in every event); Flower 1.42 offers SecAgg+ only for
its legacy strategies, and what a server sees under it (the aggregate) is audited by veil's own
engine (``federated.secagg``, `veil.federated.fedavg.secagg`). Each update w_k is turned into the
pseudo-gradient (w_global - w_k) / lr (lr: the train config's ``lr``, else 1; gradient-matching
and label attacks are invariant to that scale).

A plain `nn.Module` supports the attacks that need only its forward pass and its last linear
layer: ``ig`` / ``dlg`` (gradient matching on images) and ``labels`` (the last layer's bias
gradient); any other attack is refused in one line when `audited` is called. A veil model
(`veil.models.base.VeilModel`) is used as is, with every attack that applies to it.

The folder `out` holds, updated after every audited round:

    metrics.jsonl       {"event": "audit", round, client (node id) | "aggregate", attack, server_saw, knows,
                         seconds, stats_* (the attack's own loss), image_* / labels (evidence signals), saved}
    reconstructions/    round<r>/client<c>-<attack>.png | .json
    report.html         per-round leakage table with the reconstructions, per threat model

A server in deployment has no ground truth, so leakage is the attack's own evidence
(`veil.federated.fedavg.evidence`: matching loss, image smoothness, recovered labels) and the
reconstructions for a person to judge; `truth(round, node_id)` (simulation only) may return the
client's batch {"pixels", "labels"} to score them (PSNR, SSIM, label accuracy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch import Tensor, nn

from veil.attacks import Attack, Knowledge, Observation, Reconstruction, create_attack
from veil.attacks.harness import audit_event, score
from veil.errors import VeilError
from veil.federated.fedavg import evidence
from veil.flower.report import write_report
from veil.io import append_events
from veil.models.base import VeilModel

#: what `audited` hands an attack (`veil.attacks.base.OBSERVES`): one client's update, as a
#: pseudo-gradient, and nothing else (no earlier rounds, no candidate pool, no local schedule)
VIEWS = frozenset({"gradient", "delta"})

__all__ = ["VIEWS", "AuditedStrategy", "ModuleModel", "audited"]


class ModuleModel(VeilModel):
    """A user's image classifier seen through veil's handles: forward on {"pixels"}, the last
    `nn.Linear` as the classifier; no attention, embedding or position handles."""

    modality = "image"
    task = "classification"
    absolute_positions = False

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        self.__dict__["_head"] = linears[-1] if linears else None  # a handle, not a second registered copy

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.module(batch["pixels"])

    def classifier(self) -> nn.Module:
        if self._head is None:
            raise VeilError(f"{type(self.module).__name__} has no nn.Linear layer for the label attack to read")
        return self._head

    def attention_layers(self) -> list:
        return []

    def width(self) -> int:
        return int(self._head.in_features) if self._head is not None else 0


def _prefix(model: VeilModel) -> str:
    return "module." if isinstance(model, ModuleModel) else ""


class AuditedStrategy(Strategy):
    """A Flower strategy that attacks the updates it is handed before aggregating them."""

    def __init__(
        self,
        inner: Strategy,
        model: VeilModel,
        attacks: list[tuple[str, Attack]],
        know: Knowledge,
        every: int,
        clients: int,
        out: Path,
        truth: Callable[[int, int], dict[str, Tensor]] | None,
    ) -> None:
        self.inner, self.model, self.attacks, self.know = inner, model, attacks, know
        self.every, self.clients, self.out, self.truth = every, clients, out, truth
        self._global: dict[int, tuple[dict[str, Tensor], float]] = {}
        self.out.mkdir(parents=True, exist_ok=True)

    def __getattr__(self, name: str) -> Any:  # the wrapped strategy's own attributes (e.g. DP's clipping_norm)
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        lr = float(config["lr"]) if "lr" in config else 1.0
        self._global[server_round] = ({k: v.clone() for k, v in arrays.to_torch_state_dict().items()}, lr)
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        glob = self._global.pop(server_round, None)
        if glob is not None and (server_round % self.every == 0 or server_round == 1):
            ok = [m for m in replies if not m.has_error() and m.content.array_records]
            events = [ev for m in ok[: self.clients] for ev in self.audit(server_round, glob, m)]
            append_events(self.out / "metrics.jsonl", events)
            write_report(self.out)
        return self.inner.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

    # ---- the attacks ---------------------------------------------------------------------------
    def observation(self, glob: tuple[dict[str, Tensor], float], reply: Message) -> Observation:
        weights, lr = glob
        update = next(iter(reply.content.array_records.values())).to_torch_state_dict()
        pre = _prefix(self.model)
        state = {pre + k: v for k, v in weights.items()}
        missing = set(self.model.state_dict()) - set(state)
        if missing:
            raise VeilError(
                f"the strategy's weights do not fit the model given to audited() (e.g. '{sorted(missing)[0]}')"
            )
        self.model.load_state_dict(state)
        grads = {
            n: (p.detach() - update[n[len(pre) :]].to(p.dtype)) / lr
            for n, p in self.model.named_parameters()
            if n[len(pre) :] in update
        }
        return Observation(self.model, grads, kind="delta", batch_size=self.know.batch_size)

    def scores(self, rec: Reconstruction, rnd: int, node: int) -> dict[str, float]:
        """The reconstruction scored against the client's batch of round `rnd`, where the caller
        gave `truth`; else nothing (a server holds no ground truth)."""
        if self.truth is None:
            return {}
        if rec.images is not None:
            rec.images = rec.images.detach().float().clamp(0, 1)
        return {k: float(v) for k, v in score(rec, self.truth(rnd, node), None).items() if k != "seconds"}

    def audit(self, rnd: int, glob: tuple[dict[str, Tensor], float], reply: Message) -> list[dict]:
        node = int(reply.metadata.src_node_id)
        obs = self.observation(glob, reply)
        saw = "one client's update"  # a Message-API strategy receives every reply in the clear
        events = []
        for name, attack in self.attacks:
            ev: dict[str, Any] = {
                "event": "audit",
                "round": rnd,
                "client": node,
                "attack": name,
                "server_saw": saw,
                "knows": str(getattr(attack, "knows", "")),
            }
            ev, rec = audit_event(attack, obs, self.know, rnd, ev, lambda rec: self.scores(rec, rnd, node), "fedavg")
            if rec is None:
                events.append(ev)
                continue
            ev.update(evidence.signals(rec))
            stem = self.out / "reconstructions" / f"round{rnd:03d}" / f"client{node}-{name}"
            ev["saved"] = [str(Path(p).relative_to(self.out)) for p in evidence.save(rec, stem)]
            events.append(ev)
        return events


def audited(
    strategy: Strategy,
    model: nn.Module,
    attacks: Sequence[str | dict[str, Any]] = ("ig", "labels"),
    every: int = 1,
    out: str | Path = "veil-audit",
    input_shape: Sequence[int] | None = None,
    batch_size: int = 1,
    clients: int = 1,
    seed: int = 0,
    truth: Callable[[int, int], dict[str, Tensor]] | None = None,
) -> AuditedStrategy:
    """`strategy`, audited: the curious server's `attacks` on the updates it receives, every
    `every`-th round, on the first `clients` replies, with the user's `model` (an `nn.Module`
    taking an image batch, or a veil model); events, reconstructions and report.html in `out`.
    `input_shape` (C, H, W) and `batch_size` are what the server configured its clients with."""
    if not isinstance(strategy, Strategy):
        raise VeilError(f"audited() wraps a flwr.serverapp.strategy.Strategy, got {type(strategy).__name__}")
    if not isinstance(model, nn.Module):
        raise VeilError(f"audited() needs the app's torch nn.Module, got {type(model).__name__}")
    if every < 1 or clients < 1 or batch_size < 1:
        raise VeilError("audited(): every, clients and batch_size must be at least 1")
    veil_model = model if isinstance(model, VeilModel) else ModuleModel(model)
    made = []
    for a in attacks:
        spec = {"name": a} if isinstance(a, str) else dict(a)
        name = spec.pop("name", None)
        if not isinstance(name, str):
            raise VeilError("each attack is a name or a mapping with a 'name' key")
        attack = create_attack(name, **spec)
        extra = sorted(attack.observes - VIEWS)
        if extra:
            raise VeilError(
                f"attack '{name}' observes {', '.join(extra)}, which audited() does not hand it (one client's "
                "update, nothing else); use an attack that reads that update alone"
            )
        reason = attack.applies_to(veil_model)
        if reason and not isinstance(model, VeilModel):
            raise VeilError(
                f"attack '{name}' does not support a plain nn.Module ({type(model).__name__}): {reason}; "
                "pass a veil model for it"
            )
        if reason:
            raise VeilError(f"attack '{name}' does not apply to {type(model).__name__}: {reason}")
        made.append((name, attack))
    shape = tuple(int(s) for s in input_shape) if input_shape is not None else None
    rebuild = [n for n, a in made if a.modality == "image"]
    if shape is None and rebuild and not isinstance(model, VeilModel):  # a veil model knows its input geometry
        raise VeilError(
            f"audited(): {' / '.join(rebuild)} rebuild images of a plain module and need input_shape=(C, H, W)"
        )
    know = Knowledge(batch_size=batch_size, input_shape=shape, seed=seed)
    return AuditedStrategy(strategy, veil_model, made, know, every, clients, Path(out), truth)
