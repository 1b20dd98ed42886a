"""The GPU path (issue 21): the same code on ``cuda``. Marked ``gpu``; skipped where no CUDA device
is present (CI, 2-core machines), run on a lent GPU with ``python -m pytest -m gpu tests/test_gpu.py``.

Each test compares the GPU against the CPU on the same inputs: training with ``train.device=auto``
lands on the GPU and follows the CPU's trajectory, the span attack rebuilds the same batch, Inverting
Gradients starts from the same draw and reaches the same quality, AEGIS at zero strength is
bit-identical to no defense there too, and DP-SGD's noise is fresh every step and seeded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import TINY_RUN
from veil.attacks import Knowledge, create_attack, observe
from veil.build import load_run
from veil.config import load_config
from veil.data import load_data
from veil.defenses import create_defense
from veil.defenses.dpsgd import DPSGD
from veil.metrics import psnr
from veil.models import create_model
from veil.training.loop import pick_device, train
from veil.training.step import client_step

#: the device under test; VEIL_GPU_TESTS_ON=cpu runs the same comparisons CPU against CPU (a dry run of
#: this file where no GPU is lent)
DEV = os.environ.get("VEIL_GPU_TESTS_ON", "cuda")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device (-m gpu on a GPU)"),
]

TINY = [*TINY_RUN, "train.epochs=1", "train.max_steps=4"]


def test_auto_trains_on_the_gpu_along_the_cpu_trajectory(tmp_path: Path) -> None:
    assert pick_device("auto").type == DEV
    gpu = train(load_config(None, [*TINY, f"train.device={DEV}"]), tmp_path / "gpu", progress=False)
    cpu = train(load_config(None, [*TINY, "train.device=cpu"]), tmp_path / "cpu", progress=False)
    wg, wc = (load_run(tmp_path / d)[1].state_dict() for d in ("gpu", "cpu"))
    assert all(v.device.type == "cpu" for v in wg.values())  # checkpoints load on the CPU
    assert max(float((wg[k] - wc[k]).abs().max()) for k in wc) < 1e-3
    assert abs(gpu["test_accuracy"] - cpu["test_accuracy"]) <= 0.05


def test_cli_trains_on_the_gpu(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "veil.cli",
            "train",
            "configs/vit_digits.yaml",
            *TINY,
            "train.device=auto",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "checkpoints" / "model.safetensors").is_file()


def _span(model: torch.nn.Module, batch: dict, know: Knowledge) -> list[list[int]]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return create_attack("span").reconstruct(observe(model, batch), know).token_ids
    finally:
        torch.set_num_threads(before)


def test_span_rebuilds_the_same_batch_on_the_gpu() -> None:
    sst2 = load_data("sst2", max_len=24, train_size=300, seed=0)
    torch.manual_seed(0)
    model = create_model("transformer4", max_len=24, dim=96, depth=3).eval()
    mask = sst2.train["attention_mask"]
    idx = torch.nonzero(mask.sum(1) <= 18).flatten()[:3]
    batch = {k: v[idx] for k, v in sst2.train.items()}
    know = Knowledge(batch_size=3, seq_len=24, tokenizer=sst2.meta["tokenizer"])
    cpu = _span(model, batch, know)
    gpu = _span(model.to(DEV), {k: v.to(DEV) for k, v in batch.items()}, know)
    truth = [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
    assert sorted(cpu) == sorted(truth)
    assert sorted(gpu) == sorted(truth)


def test_inverting_gradients_on_the_gpu_reaches_the_cpu_quality() -> None:
    """A test digit from one update of vit-digits at init (tests/test_attacks_image.py's case):
    the same start on both devices (drawn on the CPU generator), the same bar."""
    digits = load_data("digits", seed=0)
    torch.manual_seed(0)
    model = create_model("vit-digits").eval()
    batch = {k: v[:1] for k, v in digits.test.items()}
    know = Knowledge(batch_size=1)
    cpu = create_attack("ig", iterations=300, restarts=1).reconstruct(observe(model, batch), know)
    model.to(DEV)
    on_dev = {k: v.to(DEV) for k, v in batch.items()}
    gpu = create_attack("ig", iterations=300, restarts=1).reconstruct(observe(model, on_dev), know)
    assert gpu.images.device.type == "cpu" and gpu.images.shape == batch["pixels"].shape
    assert psnr(batch["pixels"], gpu.images) > 22
    assert psnr(batch["pixels"], gpu.images) >= psnr(batch["pixels"], cpu.images) - 1.0
    assert gpu.labels.tolist() == batch["labels"].tolist()


def _text_model() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = create_model("transformer4", vocab_size=300, dim=32, depth=2, heads=2).to(DEV)
    ids = torch.randint(103, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 1])}
    return model, {k: v.to(DEV) for k, v in batch.items()}


def test_aegis_at_zero_strength_is_bit_identical_on_the_gpu() -> None:
    (m0, b), (m1, _) = _text_model(), _text_model()
    d = create_defense("aegis", freeze_attention=False, embed_noise=0.0, mlp_noise=0.0, mlp_down_noise=0.0).attach(m1)
    r0, r1 = client_step(m0, b, []), client_step(m1, b, [d])
    assert r0.grads.keys() == r1.grads.keys()
    assert all(torch.equal(r0.grads[k], r1.grads[k]) for k in r0.grads)


def test_dpsgd_noise_on_the_gpu_is_fresh_every_step_and_seeded() -> None:
    model, b = _text_model()
    flat = lambda g: torch.cat([v.flatten() for v in g.values()])  # noqa: E731
    d = DPSGD(clip=1.0, noise_multiplier=1.0, seed=5, mode="functorch").attach(model)
    g1, g2 = flat(client_step(model, b, [d]).grads), flat(client_step(model, b, [d]).grads)
    d.detach()
    assert g1.device.type == DEV and not torch.allclose(g1, g2)
    d = DPSGD(clip=1.0, noise_multiplier=1.0, seed=5, mode="functorch").attach(model)
    assert torch.allclose(flat(client_step(model, b, [d]).grads), g1, atol=1e-6)
    d.detach()
    assert float(g1.std()) == pytest.approx(1.0 / 3, rel=0.1)
