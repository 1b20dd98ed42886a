"""The threat model: what a curious server sees (`Observation`), what it is granted
(`Knowledge`), and what it returns (`Reconstruction`). breaching's rule holds: an attack never
receives the private batch; metrics compare against it afterwards, outside the attack.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, get_args, get_origin

import torch
from torch import Tensor, nn

from veil.attacks.options import Options, describe, parse_options
from veil.errors import VeilError
from veil.models.base import VeilModel
from veil.schema import Option


@dataclass(frozen=True)
class LocalTraining:
    """How a client produced a multi-step update, as the server knows it: the training config it
    distributed (optimizer, lr, batch size, epochs, clipping), the reply's step and sample counts,
    and — when the batch schedule is seeded from public values — which sample slots each local step
    drew. Never the client's data. Attacks that simulate the local steps read it
    (`veil.attacks.inverting_fedavg`)."""

    lr: float  # the round's learning rate
    steps: int  # local optimiser steps s
    batch_size: int
    epochs: int
    samples: int  # n distinct samples the client trained on
    optimizer: str = "adamw"  # "adamw" (veil's make_optimizer, moments from zero each round) | "sgd"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip: float | None = None  # global-norm clip of each step's clean gradient
    #: parameter name -> (lr, weight decay) of its optimiser group; absent names use (lr, 0)
    groups: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: sample slots (0..n-1) of each local step, when known; else consecutive batches, epoch by epoch
    order: tuple[tuple[int, ...], ...] | None = None
    rounds: int = 1  # updates averaged into this observation (a multi-round attacker's mean)


@dataclass
class Observation:
    """What the server saw from one client step."""

    model: VeilModel  # the weights the client started from (the server sent them)
    grads: dict[str, Tensor] = field(default_factory=dict)  # parameter name -> exported gradient
    features: Tensor | None = None  # split learning: the smashed data the server received
    kind: str = "gradient"  # "gradient" | "delta" | "features"
    local: LocalTraining | None = None  # "delta": how the client trained, when the server knows it
    #: the client's private batch, for `Attack.applies` only (attacks read Knowledge.batch_size)
    batch_size: int | None = None

    def grad(self, param: nn.Parameter | nn.Module, what: str = "weight") -> Tensor:
        """The exported gradient of a parameter (or of `module.<what>`); a one-line error if absent."""
        if isinstance(param, nn.Module):
            param = getattr(param, what)
        name = self._names().get(id(param))
        if name is None or name not in self.grads:
            raise VeilError(
                f"the observation has no gradient for {name or 'this parameter'} (frozen or not exported); this attack needs it"
            )
        return self.grads[name]

    def has_grad(self, param: nn.Parameter | nn.Module, what: str = "weight") -> bool:
        if isinstance(param, nn.Module):
            param = getattr(param, what, None)
            if param is None:
                return False
        return self._names().get(id(param)) in self.grads

    def _names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}


@dataclass
class Knowledge:
    """What the attacker is granted."""

    batch_size: int | None = None
    labels: Tensor | None = None  # known labels, or None (the attack infers them)
    input_shape: tuple[int, ...] | None = None  # e.g. (C, H, W) for images, (T,) for text
    seq_len: int | None = None
    tokenizer: Any = None  # text: maps ids <-> tokens; the attacker knows the public vocabulary
    defense: dict[str, Any] = field(default_factory=dict)  # an adaptive attacker's knowledge of the mechanism
    aux_data: Any = None  # auxiliary public data (feature-inversion attacks)
    seed: int = 0


@dataclass
class Reconstruction:
    """What the attack rebuilt, with its own statistics."""

    images: Tensor | None = None  # (B, C, H, W) in [0, 1]
    token_ids: list[list[int]] | None = None  # text sequences (without padding)
    token_set: set[int] | None = None  # presence attacks: the bag of tokens
    labels: Tensor | None = None
    #: seconds, iterations, loss, ...; and the budget's account (`Attack.reconstruct`): ``work``
    #: (unit -> count done), ``budget`` (unit -> count allowed), ``budget_used``, ``budget_stopped``
    stats: dict[str, Any] = field(default_factory=dict)


_PROGRESS = {"on": False}


@contextlib.contextmanager
def attack_progress(on: bool = True) -> Iterator[None]:
    """Within this block attacks show a progress bar over their counted work (IG, TAG, ...): the
    caller turns it on where a terminal watches (`veil attack`, a sequential audit without
    --quiet); off by default, so workers and library calls print nothing."""
    was = _PROGRESS["on"]
    _PROGRESS["on"] = bool(on)
    try:
        yield
    finally:
        _PROGRESS["on"] = was


def work_bar(total: int, desc: str) -> Any:
    """A tqdm bar over `total` units of an attack's counted work (`leave=False`), disabled unless
    `attack_progress` is on."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="it", leave=False, disable=not _PROGRESS["on"])


_WORDS = {2: "two", 3: "three", 4: "four"}
#: where each protocol an attack applies to is set (`Attack.protocols`), for the one-line reason
PROTOCOL_WORDS = {
    "single-step": "protocol: single-step",
    "fedsgd": "protocol: fedavg and federated.mode: fedsgd",
    "fedavg": "protocol: fedavg",
    "split": "protocol: split",
}

#: what an attack may observe (`Attack.observes`), the one vocabulary every engine reads: the
#: single-step harness, the FedAvg auditor (per client, over rounds, on the aggregate) and the
#: split audit supply exactly the views an attack declares, and nothing decides by its name
OBSERVES: dict[str, str] = {
    "gradient": "one client's gradient of one step (single-step, FedSGD)",
    "delta": "one client's weight change over its local steps, as a pseudo-gradient (FedAvg)",
    "features": "the head features a split-learning server receives",
    "repeats": "R exports of the same client batch from the same weights, fresh defense noise each",
    "rounds": "one client's updates averaged over every round the server received one",
    "aggregate": "the difference of consecutive global models: the previous round's aggregate",
    "candidates": "a public pool of candidate inputs that holds the private ones",
    "schedule": "how the client made its update (`LocalTraining`: optimiser, lr, steps, batch order)",
}
#: the views that make an update of each protocol: an attack applies to a protocol when it
#: observes one of them (`protocols_for`)
PROTOCOL_VIEWS: dict[str, frozenset[str]] = {
    "single-step": frozenset({"gradient"}),
    "fedsgd": frozenset({"gradient", "rounds", "aggregate"}),
    "fedavg": frozenset({"delta", "rounds", "aggregate"}),
    "split": frozenset({"features"}),
}


def protocols_for(observes: frozenset[str]) -> tuple[str, ...]:
    """The protocols whose updates offer a view the attack observes (`PROTOCOL_VIEWS`)."""
    return tuple(p for p, views in PROTOCOL_VIEWS.items() if views & observes)


OptionsT = TypeVar("OptionsT", bound=Options)


class Attack(Generic[OptionsT]):
    """Base class: `reconstruct(observation, knowledge) -> Reconstruction`.

    An attack declares its settings as its type parameter, ``class April(Attack[AprilOptions])``
    (a frozen dataclass, `veil.attacks.options`; the class's `options_type` is set from it, and a
    subclass of a concrete attack that widens its options sets `options_type` itself);
    `Attack(**settings)` checks them (unknown key or wrong type: one `VeilError` line) and keeps the
    resolved values in `self.options` and the keys as given in `self.settings`.

    Bounded work: `budget()` declares, in counted units (iterations, sentences scored, training
    steps), how much work the options allow; `{}` for a closed-form attack whose work the input
    fixes (it names that work in `closed_form`). `_reconstruct` reports what it did in the same
    units (``stats["work"]``) and whether the budget stopped it (``stats["budget_stopped"]``);
    `reconstruct` adds ``budget_used``, the largest work / budget over the units (1.0: the whole
    budget spent).
    """

    name: str = "attack"
    modality: str = "image"  # "image" | "text" | "any"
    #: the views the attack reads, words of `OBSERVES` (each attack declares it): the engines hand
    #: it these and no other, and its protocols follow from them (`protocols_for`)
    observes: ClassVar[frozenset[str]] = frozenset()
    #: what the attacker uses, in one line (the audit's worst case names it); an adaptive attacker
    #: says which part of the defense's mechanism it knows (Knowledge.defense)
    knows: str = "the exported update and the weights; not the defense (naive)"
    #: the declared options (field, type, default, help); the base declares none
    options_type: ClassVar[type[Options]] = Options
    #: a closed-form attack names its one computation here (e.g. "one least-squares solve"): the
    #: input fixes its work, so its `budget` is {}; None: the attack declares its budget itself
    closed_form: ClassVar[str | None] = None
    #: the fewest attention layers the attack reads, and what the deepest is for ("to resolve
    #: positions"): `applies_to` skips a model with fewer; (0, ""): no such need
    needs_attention_layers: ClassVar[tuple[int, str]] = (0, "")
    #: where the attack is valid beyond the model's family (`applies`): the largest private batch
    #: its equations model, and why; why the protocols its views leave out do not apply (the
    #: protocols themselves follow from `observes`); why a client training with dropout breaks it
    #: (None: dropout is fine), and the attack that applies there instead; whether it reads an
    #: untied token embedding
    max_batch: ClassVar[tuple[int, str] | None] = None
    protocols: ClassVar[tuple[str, ...]] = ()
    protocol_why: ClassVar[str] = ""
    dropout_breaks: ClassVar[tuple[str, str] | None] = None
    needs_untied_embedding: ClassVar[bool] = False

    options: OptionsT

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = sorted(set(cls.observes) - set(OBSERVES))
        if unknown:
            raise TypeError(f"{cls.__name__}.observes: unknown view {unknown[0]!r}; choose from {', '.join(OBSERVES)}")
        cls.protocols = protocols_for(cls.observes)
        if "options_type" in cls.__dict__:
            return
        for base in cls.__dict__.get("__orig_bases__", ()):  # this class's own bases, as written
            origin, args = get_origin(base), get_args(base)
            if isinstance(origin, type) and issubclass(origin, Attack) and args and isinstance(args[0], type):
                cls.options_type = args[0]

    def __init__(self, **settings: Any) -> None:
        self.options = parse_options(self.name, self.options_type, settings)
        self.settings = settings  # as given (checked): labels and reports show them

    @classmethod
    def schema(cls) -> dict[str, Option]:
        """The declared options (name, type, default, help): what `veil list --details` shows."""
        return describe(cls.options_type)

    def budget(self) -> dict[str, int] | None:
        """Unit -> amount of counted work the options allow; `{}` when the input fixes the work
        (`closed_form`); None (the base) when the attack declares none, which the tests refuse."""
        return {} if self.closed_form else None

    def reads(self, model: VeilModel) -> list[str]:
        """The parameters whose exported gradient this attack reads in closed form (a span, row
        norms, a row): what the census (`veil.attacks.census`) counts as covered. Gradient-matching
        attacks read the whole update through their objective and declare none."""
        return []

    def applies_to(self, model: VeilModel) -> str | None:
        """None if the attack applies to `model`, else the reason it is skipped."""
        if self.modality != "any" and model.modality != self.modality:
            return f"{self.name} attacks {self.modality} models; this model is {model.modality}"
        layers, why = self.needs_attention_layers
        if layers and len(model.attention_layers()) < layers:
            return f"{self.name} needs at least {_WORDS.get(layers, layers)} attention layers {why}"
        return None

    def applies(
        self, model: VeilModel | None, batch_size: int | None = None, protocol: str | None = None
    ) -> str | None:
        """None where the attack is valid, else why not (one line): the declared batch and
        protocol, then the model's family (`applies_to`), dropout and embedding needs. `batch_size`:
        the client's private batch; `protocol`: how the update was made (None: not checked); the
        client's dropout is read from the model (it trains in train mode); `model` None: the
        model-free checks only (`veil attack` makes them before loading anything). `veil attack`,
        the audit and `reconstruct` all decide here, so no cell outside these settings gets a number."""
        if self.max_batch is not None and batch_size is not None and batch_size > self.max_batch[0]:
            return f"{self.name} needs a private batch of at most {self.max_batch[0]} ({self.max_batch[1]}); got {batch_size}"
        if protocol is not None and protocol not in self.protocols:
            why = f" ({self.protocol_why})" if self.protocol_why else ""
            where = " or ".join(dict.fromkeys(PROTOCOL_WORDS[p] for p in self.protocols))
            return f"{self.name} does not model a {protocol} update{why}: use it in a task with {where}"
        if model is None:
            return None
        reason = self.applies_to(model)
        if reason:
            return reason
        if self.dropout_breaks is not None and (p := client_dropout(model)) > 0:
            why, instead = self.dropout_breaks
            return f"{self.name} {why}; the client trains with dropout {p:g}: use {instead}"
        if self.needs_untied_embedding and tied_embedding(model):
            return f"{self.name} reads the token-embedding rows, which this model ties to its LM head (every row gets gradient)"
        return None

    def reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        # the protocol is checked where an audit plans its cells (`applies(..., protocol)`); here only
        # what the observation itself shows: split-learning features, the batch, the model
        protocol = "split" if obs.kind == "features" else None
        reason = self.applies(obs.model, obs.batch_size, protocol)
        if reason:
            raise VeilError(reason)
        t0 = time.perf_counter()
        rec = self._reconstruct(obs, know)
        rec.stats.setdefault("seconds", time.perf_counter() - t0)
        account(rec.stats, self.budget())
        return rec

    def _reconstruct(self, obs: Observation, know: Knowledge) -> Reconstruction:
        raise NotImplementedError


def client_dropout(model: nn.Module) -> float:
    """The largest dropout rate among the model's dropout modules (and a Hugging Face config's
    hidden / embedding dropout): what the client's step applies; 0 for a model in eval mode."""
    if not model.training:
        return 0.0
    p = max((float(m.p) for m in model.modules() if isinstance(m, nn.Dropout)), default=0.0)
    cfg = getattr(getattr(model, "hf", None), "config", None)
    return max([p] + [float(getattr(cfg, k, 0.0) or 0.0) for k in ("hidden_dropout_prob", "embd_pdrop")])


def tied_embedding(model: VeilModel) -> bool:
    """Whether the model's output head is its token embedding (one tensor)."""
    try:
        emb, head = model.token_embedding(), model.classifier()
    except (AttributeError, NotImplementedError):
        return False
    w = getattr(emb, "weight", None)
    return w is not None and getattr(head, "weight", None) is w


def account(stats: dict[str, Any], budget: dict[str, int] | None) -> None:
    """Fill the budget's account in an attack's `stats`: ``budget``, ``work`` (what the attack
    reported, `{}` if nothing), ``budget_used`` = max over the budget's units of work / budget (0.0
    for a closed-form attack) and ``budget_stopped`` (False unless the attack said so)."""
    if budget is None:
        return
    work = {str(k): int(v) for k, v in dict(stats.get("work") or {}).items()}
    stats["work"] = work
    stats["budget"] = dict(budget)
    stats["budget_used"] = max((work.get(u, 0) / b for u, b in budget.items() if b > 0), default=0.0)
    stats["budget_stopped"] = bool(stats.get("budget_stopped", False))


def param_names(model: nn.Module, params: list[Any]) -> list[str]:
    """The names of `params` (parameters or modules: their weight and bias) in `model`."""
    ids = {id(p): n for n, p in model.named_parameters()}
    out: list[str] = []
    for p in params:
        for q in [getattr(p, "weight", None), getattr(p, "bias", None)] if isinstance(p, nn.Module) else [p]:
            if q is not None and id(q) in ids and ids[id(q)] not in out:
                out.append(ids[id(q)])
    return out


def observe(model: VeilModel, batch: dict[str, Tensor], defenses: list | None = None, step: int = 0) -> Observation:
    """Run one defended client step (no optimiser step) and wrap what the server sees."""
    from veil.training.step import client_step

    was_training = model.training
    res = client_step(model, batch, defenses or [], optimizer=None, step=step)
    model.train(was_training)
    return Observation(model=model, grads=res.grads or {}, batch_size=len(next(iter(batch.values()))))


def set_seed(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g
