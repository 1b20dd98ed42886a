"""Client-level DP on Flower (`federated.dp`): clipping bounds what a client contributes, the
server's noise has std z C / k, zero strength equals no DP, adaptive clipping moves the clip the
way Andrew et al. do, epsilon equals Opacus's accountant, and bad keys are one-line errors.
2 clients, in-process grid (real Flower messages), a 1-layer width-16 ViT on digits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from opacus.accountants import RDPAccountant
from safetensors.torch import load_file

from helpers import FED_TINY as TINY
from helpers import events, fed_config, kill_server_after_round
from veil.errors import VeilError
from veil.federated.fedavg.task import client_world, load_spec


def spec(tmp: Path, *overrides: str):
    p = fed_config(tmp, "clients: 2, rounds: 2, partition: iid, local_steps: 2, secret: seeded")
    return load_spec(p, [*TINY, *overrides])


def run(tmp: Path, name: str, *overrides: str) -> tuple[dict, dict[str, torch.Tensor], list[dict]]:
    """(summary, final global weights, round events) of a federated run."""
    from veil.federated.fedavg.runner import federate

    s = federate(spec(tmp, *overrides), tmp / name)
    rounds = [e for e in events(tmp / name) if e["event"] == "round"]
    return s, load_file(str(tmp / name / "checkpoints" / "model.safetensors")), rounds


def one_dp_round(tmp: Path, kind: str, noise: str, clip: str) -> tuple[dict, dict[str, torch.Tensor], list[dict]]:
    """`run` of one round under `federated.dp=kind` with that noise multiplier and clip, as run "dp"."""
    return run(
        tmp,
        "dp",
        "federated.rounds=1",
        f"federated.dp={kind}",
        f"federated.dp_noise={noise}",
        f"federated.dp_clip={clip}",
    )


def flat(w: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([w[k].flatten().double() for k in sorted(w)])


def initial(tmp: Path, *overrides: str) -> dict[str, torch.Tensor]:
    return client_world(spec(tmp, *overrides).text()).initial


def test_without_dp_the_spec_text_has_no_dp_keys(tmp_path: Path) -> None:
    assert "dp" not in spec(tmp_path).raw["federated"]  # old run folders and message sizes unchanged
    assert spec(tmp_path, "federated.dp=client-fixed").raw["federated"]["dp_noise"] == 1.0


@pytest.mark.parametrize("kind", ["client-fixed", "server-fixed"])
def test_zero_noise_and_a_clip_never_reached_equal_no_dp(tmp_path: Path, kind: str) -> None:
    """One round (a second one would let Adam blow float rounding up along the attention key bias,
    whose gradient is 0 up to rounding)."""
    _, plain, _ = run(tmp_path, "none", "federated.rounds=1")
    s, dp, rounds = one_dp_round(tmp_path, kind, "0.0", "1000000.0")
    assert (flat(plain) - flat(initial(tmp_path))).abs().max() > 1e-3  # the round did train
    assert torch.allclose(flat(dp), flat(plain), rtol=0, atol=1e-6)  # only (w - w0) + w0 rounding differs
    assert s["dp"]["epsilon"] is None and all(e["dp_epsilon"] is None and e["dp_released"] for e in rounds)


def test_noise_std_is_z_clip_over_k(tmp_path: Path) -> None:
    """One round, a clip no update reaches: the DP global model minus the plain one is the noise."""
    _, plain, _ = run(tmp_path, "none", "federated.rounds=1")
    assert (flat(plain) - flat(initial(tmp_path))).norm() < 10.0  # the clip below is never reached
    _, dp, _ = one_dp_round(tmp_path, "client-fixed", "0.02", "10")
    noise = flat(dp) - flat(plain)
    assert noise.numel() > 2000 and abs(float(noise.std()) / (0.02 * 10 / 2) - 1) < 0.1, float(noise.std())
    assert abs(float(noise.mean())) < 0.01


@pytest.mark.parametrize("kind", ["client-fixed", "server-fixed"])
def test_clipping_bounds_the_global_update(tmp_path: Path, kind: str) -> None:
    w0 = flat(initial(tmp_path))
    _, plain, _ = run(tmp_path, "none", "federated.rounds=1")
    _, dp, _ = one_dp_round(tmp_path, kind, "0.0", "0.001")
    assert (flat(plain) - w0).norm() > 0.01
    assert 0.0005 < (flat(dp) - w0).norm() <= 0.001 * (1 + 1e-4)  # the mean of two updates clipped to 0.001


@pytest.mark.parametrize("kind", ["client-adaptive", "server-adaptive"])
@pytest.mark.parametrize("clip0,direction", [(1e-4, +1), (1e6, -1)])
def test_adaptive_clip_moves_towards_the_target_quantile(
    tmp_path: Path, kind: str, clip0: float, direction: int
) -> None:
    """Noise 0: every update clipped (clip 1e-4) -> b = 0, C grows by exp(eta gamma) a round;
    none clipped (1e6) -> b = 1, C shrinks by exp(-eta (1 - gamma)) (Andrew et al., Alg. 1)."""
    _, _, rounds = run(tmp_path, "dp", f"federated.dp={kind}", "federated.dp_noise=0.0", f"federated.dp_clip={clip0}")
    step = 0.2 * 0.5  # eta = 0.2, gamma = 0.5
    assert [e["dp_clip"] for e in rounds] == pytest.approx(
        [clip0 * math.exp(direction * step * r) for r in (1, 2)], rel=1e-9
    )


@pytest.mark.parametrize("fraction,delta", [(0.5, 1e-3), (1.0, 0.0)])
def test_epsilon_is_opacus_rdp_per_round(tmp_path: Path, fraction: float, delta: float) -> None:
    s, _, rounds = run(
        tmp_path,
        "dp",
        "federated.dp=server-fixed",
        "federated.dp_noise=1.1",
        "federated.dp_clip=0.1",
        f"federated.fraction={fraction}",
        f"federated.dp_delta={delta}",
    )
    acc, want = RDPAccountant(), []
    for _ in rounds:
        acc.step(noise_multiplier=1.1, sample_rate=fraction)
        want.append(acc.get_epsilon(delta or 1 / 2))
    assert [e["dp_epsilon"] for e in rounds] == pytest.approx(want, rel=1e-12) and want[1] > want[0] > 0
    assert s["dp"]["epsilon"] == pytest.approx(want[-1], rel=1e-12)
    assert s["dp"]["delta"] == (delta or 0.5) and s["dp"]["sample_rate"] == fraction
    assert [e["replies"] for e in rounds] == [int(2 * fraction)] * 2


def test_a_round_missing_a_client_releases_nothing(tmp_path: Path) -> None:
    _, w, rounds = run(
        tmp_path,
        "dp",
        "federated.rounds=1",
        "federated.dp=client-fixed",
        "federated.dp_noise=1.0",
        "federated.fail={client: 1, round: 1, mode: raise}",
    )
    assert rounds[0]["replies"] == 1 and rounds[0]["dp_released"] is False
    assert torch.equal(flat(w), flat(initial(tmp_path)))  # noise calibrated to 2 replies is not released over 1


@pytest.mark.parametrize(
    "override,match",
    [
        ("federated.dp=gaussian", "federated.dp must be one of none, client-fixed"),
        ("federated.dp_noise=0.5", "federated.dp_noise is set but federated.dp is none"),
        ("federated.dp=client-fixed federated.dp_noise=-1", "federated.dp_noise must be a noise multiplier >= 0"),
        ("federated.dp=server-fixed federated.dp_clip=0", "federated.dp_clip must be a clipping norm > 0"),
        ("federated.dp=server-fixed federated.dp_delta=1", r"federated.dp_delta must be in \[0, 1\)"),
        ("federated.dp=client-fixed federated.mode=fedsgd", "needs federated.mode=fedavg"),
        ("federated.dp=client-adaptive federated.dp_noise=1.0", "needs dp_count_std > 0.5 for adaptive clipping"),
    ],
)
def test_bad_dp_keys_are_one_line_errors(tmp_path: Path, override: str, match: str) -> None:
    with pytest.raises(VeilError, match=match) as e:
        spec(tmp_path, *override.split())
    assert "\n" not in str(e.value)


def test_killed_dp_run_resumes_to_the_same_weights_clip_and_epsilon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adaptive clipping's C and the server's noise (seeded per round with `secret: seeded`)
    continue where the run stopped."""
    from veil.federated.fedavg.runner import federate

    dp = [
        "federated.rounds=3",
        "federated.dp=server-adaptive",
        "federated.dp_noise=0.3",
        "federated.dp_count_std=0.5",
        "federated.dp_clip=0.01",
    ]
    _, full, rounds_full = run(tmp_path, "full", *dp)
    undo = kill_server_after_round(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "cut", *dp)
    undo()
    federate(spec(tmp_path, *dp), tmp_path / "cut", resume=True)
    _, cut, rounds_cut = run(tmp_path, "cut", *dp)  # finished: returns the summary
    assert torch.equal(flat(full), flat(cut))
    keys = ("round", "dp_clip", "dp_epsilon", "test_accuracy")
    assert [{k: e[k] for k in keys} for e in rounds_cut] == [{k: e[k] for k in keys} for e in rounds_full]
    assert len({e["dp_clip"] for e in rounds_full}) == 3  # the clip did move every round


@pytest.mark.slow
def test_ray_simulation_runs_client_side_dp_like_the_inline_grid(tmp_path: Path) -> None:
    """Flower's simulation engine (Ray): the clipping mod runs in the client processes, and with
    seeded secrets and noise the run ends on the inline grid's weights and epsilons."""
    import os
    import subprocess
    import sys

    dp = ["federated.dp=client-fixed", "federated.dp_noise=0.7", "federated.dp_clip=0.05"]
    _, inline, rounds_inline = run(tmp_path, "inline", *dp)
    args = [
        str(tmp_path / "fed.yaml"),
        *TINY,
        *dp,
        "federated.backend=ray",
        "federated.timeout=120",
        "--out",
        str(tmp_path / "ray"),
        "--quiet",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "veil.cli", "federate", *args],
        env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ray = load_file(str(tmp_path / "ray" / "checkpoints" / "model.safetensors"))
    assert torch.equal(flat(ray), flat(inline))
    assert [e["dp_epsilon"] for e in events(tmp_path / "ray") if e["event"] == "round"] == [
        e["dp_epsilon"] for e in rounds_inline
    ]
    assert json.loads((tmp_path / "ray" / "summary.json").read_text())["dp"]["epsilon"] > 0


def test_adaptive_epsilon_accounts_the_noisy_count_at_sensitivity_one(tmp_path: Path) -> None:
    """z = 0.5, count std s = 1: update noise z_D = (z^-2 - (2s)^-2)^-1/2 (Flower) and the count
    noise s compose to (z_D^-2 + s^-2)^-1/2 = (4 + 0.75)^-1/2 = 0.4588, below z."""
    from veil.federated.fedavg import dp

    fed = spec(tmp_path, "federated.dp=client-adaptive", "federated.dp_noise=0.5", "federated.dp_count_std=1.0").fed
    z_d = (0.5**-2 - 2.0**-2) ** -0.5
    assert dp.accounted_noise(fed) == pytest.approx((z_d**-2 + 1.0) ** -0.5, rel=1e-12) == pytest.approx(4.75**-0.5)
    acc = RDPAccountant()
    acc.history = [(4.75**-0.5, 1.0, 3)]
    fixed = spec(tmp_path, "federated.dp=client-fixed", "federated.dp_noise=0.5").fed
    assert dp.epsilon(fed, 3) == pytest.approx(acc.get_epsilon(0.5), rel=1e-9)
    assert dp.epsilon(fed, 3) > dp.epsilon(fixed, 3)


def test_local_dp_noises_each_update_with_std_2zC(tmp_path: Path) -> None:
    """`local`: each client adds N(0, (2 z C)^2) to its clipped update; the global model is the
    mean of two, so its noise std is 2 z C / sqrt(2). Epsilon: RDP at q = 1 even when fraction < 1."""
    _, plain, _ = run(tmp_path, "none", "federated.rounds=1")
    s, dp, rounds = run(
        tmp_path, "dp", "federated.rounds=1", "federated.dp=local", "federated.dp_noise=0.01", "federated.dp_clip=10"
    )
    noise = flat(dp) - flat(plain)
    assert abs(float(noise.std()) / (2 * 0.01 * 10 / math.sqrt(2)) - 1) < 0.1, float(noise.std())
    acc = RDPAccountant()
    acc.history = [(0.01, 1.0, 1)]
    assert rounds[0]["dp_epsilon"] == pytest.approx(acc.get_epsilon(0.5), rel=1e-12) == s["dp"]["epsilon"]
    half = spec(tmp_path, "federated.dp=local", "federated.dp_noise=2.0", "federated.fraction=0.5").fed
    from veil.federated.fedavg import dp as fdp

    acc.history = [(2.0, 1.0, 5)]
    assert fdp.sample_rate(half) == 1.0 and fdp.epsilon(half, 5) == pytest.approx(acc.get_epsilon(0.5), rel=1e-12)


def test_local_dp_noise_follows_the_client_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded: two runs add the same noise (and so could a server that knows the seed). Random:
    the noise is not the seeded one, and a new client process (a fresh process secret) draws new noise."""
    from veil.federated import client_secret

    dp = ["federated.rounds=1", "federated.dp=local", "federated.dp_noise=0.5", "federated.dp_clip=0.1"]
    _, s1, _ = run(tmp_path, "s1", *dp, "federated.secret=seeded")
    _, s2, _ = run(tmp_path, "s2", *dp, "federated.secret=seeded")
    _, r1, _ = run(tmp_path, "r1", *dp, "federated.secret=random")
    monkeypatch.setattr(client_secret, "_process_secret", None)  # as in a new client process
    _, r2, _ = run(tmp_path, "r2", *dp, "federated.secret=random")
    assert torch.equal(flat(s1), flat(s2))
    assert not torch.equal(flat(r1), flat(s1)) and not torch.equal(flat(r1), flat(r2))
