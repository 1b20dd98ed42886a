"""The attack harness shared by `veil attack`, `veil audit` and the results scripts: draw the
client's private batches, run one defended client step, hand the server's view (and only that)
to the attack, and score the reconstruction against the private batch afterwards.

The server runs the plain model: the client's embedding transform (e.g. MJP's random shuffle)
is not replayed during the attack (`attacker_view`). For MJP setting (b) the shuffled input is
recorded during the client's step (`recorded_order`) and used as the scoring reference. For text
the evaluator also keeps which slots the shuffle selected and which tokens it moved
(`shuffle_record`; never given to the attacker): `score` reports unshuffled_recovery and
moved_tokens from them.

Every engine attacks an update the same way (`update_seed`, `attack_view`, `score`): the
single-step harness here (`attack_once`: `veil attack`, the audit's cells), the FedAvg auditor and
the Flower strategy wrapper (`audit_event`, on the updates a server received). The `index`-th
attacked update of a run seeded `seed` seeds torch's stream, and `Knowledge.seed`, with
``seed * 1000 + index`` before anything of that update draws from it (the client's defended step
here, the attack there); the attack then runs on the server's view (`attack_view`), and the
reconstruction is scored against the private batch afterwards (`score`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from veil.attacks.adaptive import observe_rounds, random_guess_f1
from veil.attacks.base import Attack, Knowledge, Observation, Reconstruction, observe
from veil.attacks.options import check_device
from veil.errors import VeilError
from veil.metrics.leakage import EXACT_DB
from veil.models.base import VeilModel

REFERENCES = ("original", "shuffled")


def private_batches(split: dict[str, Tensor], batch_size: int, samples: int, seed: int) -> list[dict[str, Tensor]]:
    """`samples` disjoint batches drawn (seeded) from the split."""
    n = len(next(iter(split.values())))
    if batch_size < 1 or samples < 1:
        raise VeilError(f"--batch-size and --samples must be at least 1, got {batch_size} and {samples}")
    if batch_size * samples > n:
        raise VeilError(
            f"{samples} samples of batch {batch_size} need {batch_size * samples} examples; the test split has {n}"
        )
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: batch_size * samples]
    return [{k: v[idx] for k, v in split.items()} for idx in order.reshape(samples, batch_size)]


# ---- one attacked update: its seed, the attack on the server's view ------------------------------
def update_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th attacked update of a run seeded `seed` (each engine's index: the
    sample of a cell, the round of a federated run); runs of different seeds draw disjoint seeds
    for their first thousand updates."""
    return seed * 1000 + index


def attack_view(attack: Attack, obs: Observation, know: Knowledge) -> Reconstruction:
    """The attack on one server view, with the plain model the server runs (`attacker_view`); the
    model's gradients are cleared afterwards."""
    if obs.model is None:  # split learning: the server holds features, not the client's model
        return attack.reconstruct(obs, know)
    with attacker_view(obs.model):
        rec = attack.reconstruct(obs, know)
    obs.model.zero_grad(set_to_none=True)
    return rec


def audit_event(
    attack: Attack,
    obs: Observation,
    know: Knowledge,
    index: int,
    ev: dict[str, Any],
    scores: Callable[[Reconstruction], dict[str, Any]],
    protocol: str | None = None,
) -> tuple[dict[str, Any], Reconstruction | None]:
    """A server's attack on an update it received (the FedAvg auditor, the Flower wrapper): `ev`
    with why the attack was skipped, or its error (a failing attack is logged, never stops
    training), or its ``seconds``, budget account (`budget_metrics`) and `scores` of the
    reconstruction; the reconstruction too (None when skipped or failed). `index`: the update's
    index in the run (its round): torch's stream and `Knowledge.seed` take `update_seed`.
    `protocol`: how the update was made, where the caller has not checked it (`Attack.applies`)."""
    reason = attack.applies(obs.model, obs.batch_size, protocol)
    if reason:
        return {**ev, "skipped": reason}, None
    seed = update_seed(know.seed, index)
    torch.manual_seed(seed)
    try:
        rec = attack_view(attack, obs, replace(know, seed=seed))
    except Exception as e:  # noqa: BLE001 - a failing attack is logged, never stops training
        return {**ev, "error": f"{type(e).__name__}: {e}"[:300]}, None
    ev = {**ev, "seconds": round(float(rec.stats.get("seconds", 0.0)), 3), **budget_metrics(rec.stats)}
    return {**ev, **scores(rec)}, rec


# ---- observing: the defended step, the shuffled reference, the attacker's view ------------------
@contextmanager
def recorded_order(model: VeilModel) -> Iterator[dict[str, Tensor]]:
    """Wrap the model's embedding transform to learn where each token went (for setting (b))."""
    record: dict[str, Tensor] = {}
    inner = model.embedding_transform
    if inner is None:
        yield record
        return

    def spy(tok: Tensor, pos: Tensor, movable: Tensor) -> tuple[Tensor, Tensor]:
        out_tok, out_pos = inner(tok, pos, movable)
        d = torch.cdist(out_tok.detach().float(), tok.detach().float())  # (B, N_out, N_in)
        record["order"] = d.argmin(-1)  # slot j holds input token order[b, j]
        record.update(mask_state(inner, movable))
        return out_tok, out_pos

    model.set_embedding_transform(None)
    model.set_embedding_transform(spy)
    try:
        yield record
    finally:
        model.set_embedding_transform(None)
        model.set_embedding_transform(inner)


def mask_state(transform: Any, movable: Tensor) -> dict[str, Tensor]:
    """The truth of an MJP step, for scoring only: ``mjp_mask`` (B, N) the masked (selected) slots,
    ``mjp_perm`` (B, N) the index map (slot j holds token perm[b, j]); nothing if the transform
    is not MJP's. With gamma 0 nothing is masked or moved."""
    state = getattr(getattr(transform, "__self__", None), "last", None)
    if state is None or not hasattr(state, "perm"):
        return {}
    if state.mask is None:
        B, N = movable.shape
        return {"mjp_mask": torch.zeros(B, N, dtype=torch.bool), "mjp_perm": torch.arange(N).expand(B, N).clone()}
    return {"mjp_mask": state.mask.detach().cpu().clone(), "mjp_perm": state.perm.detach().cpu().clone()}


@contextmanager
def attacker_view(model: VeilModel) -> Iterator[None]:
    """The server runs the plain model: the client's embedding transform is not replayed."""
    inner = model.embedding_transform
    model.set_embedding_transform(None)
    try:
        yield
    finally:
        model.set_embedding_transform(inner)


def shuffled_reference(model: VeilModel, batch: dict[str, Tensor], order: Tensor | None) -> dict[str, Tensor]:
    """The batch as the model saw it after the defense's shuffle."""
    if order is None:
        return batch
    out = dict(batch)
    if "pixels" in batch:
        from veil.attacks.analytic_vit import patch_geometry
        from veil.models.vit import patchify, unpatchify

        p, chans, size = patch_geometry(model)
        patches = patchify(batch["pixels"], p)
        moved = torch.gather(patches, 1, order.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))
        out["pixels"] = unpatchify(moved, p, chans, size)
    else:
        out["input_ids"] = torch.gather(batch["input_ids"], 1, order)
    return out


def knowledge_for(
    batch: dict[str, Tensor], data: Any, defenses: list, seed: int, grant: dict[str, Any] | None = None
) -> Knowledge:
    """What the attacker is granted. By default: batch size, input shape, the public tokenizer and
    the defense's settings (an adaptive attacker), not the labels. `grant` switches each off/on:
    {labels: bool, batch_size: bool, seq_len: bool, defense: bool, candidates: bool}; candidates (the
    test split's inputs as `aux_data["candidates"]`) is on for an attack that observes "candidates"."""
    grant = {
        "labels": False,
        "batch_size": True,
        "seq_len": True,
        "defense": True,
        "candidates": False,
        **(grant or {}),
    }
    B = len(next(iter(batch.values())))
    # a candidate pool that holds the private batch (the attacked batches are drawn from the test split)
    pool = {"candidates": {k: v for k, v in data.test.items() if k != "labels"}} if grant["candidates"] else None
    shape = tuple(batch["pixels"].shape[1:]) if "pixels" in batch else (batch["input_ids"].shape[1],)
    return Knowledge(
        batch_size=B if grant["batch_size"] else None,
        input_shape=shape,
        seq_len=shape[0] if "input_ids" in batch and grant["seq_len"] else None,
        labels=batch["labels"].clone() if grant["labels"] and "labels" in batch else None,
        tokenizer=data.meta.get("tokenizer"),
        defense={d.name: d.describe() for d in defenses} if grant["defense"] else {},
        aux_data=pool,
        seed=seed,
    )


def attack_once(
    attack: Attack,
    model: VeilModel,
    batch: dict[str, Tensor],
    defenses: list,
    data: Any,
    reference: str,
    seed: int,
    grant: dict[str, Any] | None = None,
) -> tuple[Reconstruction, dict[str, Tensor], Observation]:
    """One defended client step, the attack on what the server saw, and the reference to score
    against. `seed`: the update's seed (`update_seed`); torch's stream takes it before the client's
    step, so the step's own draws (dropout, a defense's noise) are seeded too."""
    torch.manual_seed(seed)
    device = model_device(model)  # the attack phase runs where the caller put the model (`attack_device`)
    sent = batch if device.type == "cpu" else {k: v.to(device) for k, v in batch.items()}
    with recorded_order(model) as rec:
        obs = observe(model, sent, defenses)
    rec = {k: v.cpu() for k, v in rec.items()}  # the evaluator's record, beside the private batch
    ref = shuffled_reference(model, batch, rec.get("order")) if reference == "shuffled" else batch
    ref = {**ref, **{k: v for k, v in rec.items() if k.startswith("mjp_")}}  # the evaluator's truth, never the attack's
    if "input_ids" in batch and rec.get("order") is not None:  # text: which slots the client's shuffle touched
        ref = {**ref, **shuffle_record(batch, rec["order"], defenses)}
    if "candidates" in attack.observes:
        grant = {**(grant or {}), "candidates": True}
    know = knowledge_for(sent, data, defenses, seed, grant)
    rounds = attack.options.rounds if "repeats" in attack.observes else 0  # its options declare how many
    if rounds > 1:  # the server sees the same client export this batch R times (fresh defense noise each)
        others = [o.grads for o in observe_rounds(model, sent, defenses, rounds)[1:]]
        know.aux_data = {**(know.aux_data or {}), "rounds": others}
    return on_cpu(attack_view(attack, obs, know)), ref, obs


def attack_device(name: str) -> torch.device:
    """The device `attack.device` names (`DEVICES`; auto: CUDA when present, else the CPU); a
    one-line error for another value, or for cuda on a machine without it."""
    check_device(name)
    if name == "cuda" and not torch.cuda.is_available():
        raise VeilError("attack.device=cuda but no CUDA device is available; use auto or cpu")
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


def model_device(model: VeilModel) -> torch.device:
    """Where the model's weights are (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def on_cpu(rec: Reconstruction) -> Reconstruction:
    """The reconstruction's tensors on the CPU, where the private batch and the metrics are."""
    if rec.images is not None and rec.images.device.type != "cpu":
        rec.images = rec.images.cpu()
    if rec.labels is not None and rec.labels.device.type != "cpu":
        rec.labels = rec.labels.cpu()
    return rec


def shuffle_record(batch: dict[str, Tensor], order: Tensor, defenses: list) -> dict[str, Tensor]:
    """Text: ``moved`` (B, T), the slots whose token the client's shuffle changed, and ``shuffled``,
    the slots the defense selected (MJP's own record of the step, `JigsawState.mask`; a selected
    token the permutation left in place is shuffled but not moved). The evaluator's knowledge."""
    ids = batch["input_ids"]
    out = {"moved": torch.gather(ids, 1, order) != ids}
    for d in defenses:
        mask = getattr(getattr(d, "last", None), "mask", None)
        if isinstance(mask, Tensor) and mask.shape == ids.shape:
            out["shuffled"] = mask.detach().cpu().bool()
    return out


# ---- scoring -------------------------------------------------------------------------------------
def score(rec: Reconstruction, ref: dict[str, Tensor], data: Any) -> dict[str, float]:
    """Every metric the reconstruction supports, against the reference batch."""
    from veil.metrics import image_report, presence, text_report

    out: dict[str, float] = {}
    if rec.images is not None:
        report = image_report(ref["pixels"], rec.images)
        out.update({k: float(v) for k, v in report.items() if k != "order"})
        if "mjp_mask" in ref:
            out.update(shuffle_scores(ref, rec.images, report["order"]))
    if rec.token_ids is not None:
        flags = {k: sequences({**ref, "input_ids": ref[k]}) for k in ("moved", "shuffled") if k in ref}
        out.update(
            {
                k: float(v)
                for k, v in text_report(sequences(ref), rec.token_ids, ignore=special_ids(data), **flags).items()
                if k != "order"
            }
        )
    if (
        rec.token_set is not None or rec.token_ids is not None
    ):  # a text attack's bag: its token set, else its sentences' tokens
        true = {int(t) for t in ref["input_ids"][ref["attention_mask"].bool()].tolist()} - set(special_ids(data))
        bag = (
            rec.token_set
            if rec.token_set is not None
            else {int(t) for s in rec.token_ids for t in s} - set(special_ids(data))
        )
        out.update(
            {f"presence_{k}" if not k.startswith("presence") else k: float(v) for k, v in presence(true, bag).items()}
        )
        out["presence_guesses"] = float(len(bag))
        vocab = getattr(data.meta.get("tokenizer"), "vocab_size", None)
        if vocab:  # the F1 of as many guesses drawn at random: a presence F1 means something only above it
            out["presence_random_f1"] = random_guess_f1(len(true), len(bag), int(vocab))
    if rec.labels is not None and "labels" in ref:
        from veil.attacks.labels import label_accuracy

        out["label_accuracy"] = label_accuracy(ref["labels"], rec.labels)
    out["seconds"] = float(rec.stats.get("seconds", 0.0))
    if "iterations_per_second" in rec.stats:
        out["iterations_per_second"] = float(rec.stats["iterations_per_second"])
    out.update(budget_metrics(rec.stats))
    return out


def budget_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """A budgeted attack's account as cell metrics: ``budget_used`` (work / budget) and
    ``budget_stopped`` (1.0 / 0.0); {} for a closed-form attack (it declares {}: its input fixes
    the work). Every engine (single step, FedAvg audit, split feature attacks) reports it so."""
    if not stats.get("budget"):
        return {}
    return {"budget_used": float(stats["budget_used"]), "budget_stopped": float(bool(stats["budget_stopped"]))}


def shuffle_scores(ref: dict[str, Tensor], images: Tensor, order: list[int]) -> dict[str, float]:
    """What leaks from an MJP image update (`veil.metrics.image.patch_report`), on the images the
    whole-image scores paired: masked / moved patch counts of the update, the unmasked patches at
    their positions, the masked patches as a set. The whole-image psnr / ssim are bounded by the
    masked patches' order, which the update does not hold."""
    from veil.metrics.image import patch_report

    mask, perm = ref["mjp_mask"], ref["mjp_perm"]
    out = {"masked_patches": float(mask.sum()), "moved_patches": float((perm != torch.arange(perm.shape[1])).sum())}
    pairs = [(i, j) for i, j in enumerate(order) if j >= 0]
    rows, cols = [i for i, _ in pairs], [j for _, j in pairs]
    out.update(patch_report(ref["pixels"][rows], images[cols].detach().clamp(0, 1), mask[rows]))
    return out


def sequences(batch: dict[str, Tensor]) -> list[list[int]]:
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    return [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], mask)]


def special_ids(data: Any) -> list[int]:
    return list(data.meta.get("special_ids", [])) if data is not None else []


#: metrics rolled up over a cell's samples by another rule than the mean: the budget stopped any of
#: them (1.0 / 0.0); the most of its budget one sample spent (beside the mean `budget_used`)
_ANY, _MAX = ("budget_stopped",), {"budget_used_max": "budget_used"}
#: image PSNR keys: a sample above EXACT_DB is an exact copy (an identified image scores inf)
_PSNR = ("psnr", "psnr_unshuffled", "psnr_masked_set")


def _psnr_mean(values: list[float]) -> tuple[float, float]:
    """(mean PSNR, share of exact samples). When only some samples are exact, each counts at
    EXACT_DB: one identified image (inf) beside one missed must not read as an inf mean."""
    exact = [v >= EXACT_DB for v in values]
    if any(exact) and not all(exact):
        values = [min(v, EXACT_DB) for v in values]
    return sum(values) / len(values), sum(exact) / len(exact)


def mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each metric over the samples; ``budget_stopped`` is any over them, and
    ``budget_used_max`` the largest ``budget_used``. A PSNR key gets ``KEY_exact``, the share of
    samples rebuilt exactly, whenever one was (see `_psnr_mean`)."""
    keys = sorted({k for r in rows for k in r})
    out = {k: sum(r[k] for r in rows if k in r) / sum(1 for r in rows if k in r) for k in keys}
    for k in _ANY:
        if k in out:
            out[k] = float(any(r.get(k, 0.0) for r in rows))
    for k, src in _MAX.items():
        if src in out:
            out[k] = max(r[src] for r in rows if src in r)
    for k in _PSNR:
        if k in out:
            out[k], share = _psnr_mean([float(r[k]) for r in rows if k in r])
            if share:
                out[f"{k}_exact"] = share
    return out
