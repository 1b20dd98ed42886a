"""Inverting Gradients and APRIL: veil side by side with breaching (PyPI `breaching` 0.1.2).

Not part of CI: breaching lives in its own virtualenv, outside the repository. Make it once
(x86_64; PyPI's torchvision does not import beside veil's torch 2.13.0 CPU wheel, so that venv
takes torch 2.14.1 + torchvision 0.29.1, a CUDA build that runs on the CPU, ~5.5 GB; timm for
breaching's APRIL model):

    python3 -m venv /work/venvs/breaching
    /work/venvs/breaching/bin/pip install torch==2.14.1 torchvision==0.29.1
    /work/venvs/breaching/bin/pip install breaching==0.1.2 hydra-core safetensors timm

then, from the repository root, in veil's own environment:

    python benchmarks/ig_vs_breaching.py [--iterations 200] [--repeats 2] [--threads 1] [--write]
        [--breaching-python /work/venvs/breaching/bin/python]

What is compared (one script, one run, the same machine):

* IG (Geiping et al. 2020). The same ViT (veil's `vit-tiny`: patch 4, width 192, depth 6, 3
  heads, 32x32x3, 2 classes, built by veil with a fixed seed; its weights reach the breaching
  side through a safetensors file and load into `_breaching_side.PlainViT`, the same forward in
  plain torch), the same image (an LFW face from veil's shipped loader, grey in 3 channels), the
  same client update (veil's `observe`), the same objective (1 - cosine over every parameter's
  gradient + tv * TV, breaching's stock `invertinggradients` with its TV scale set to veil's),
  the same start image (veil's first draw, handed to breaching as `initial_data`), signed Adam
  at the same lr with the paper's x0.1 step decay at 3/8, 5/8, 7/8 of the budget, box [0, 1],
  the same iteration budget N, the same torch threads. veil's step is its default `engine=auto`: on
  its own ViT the gradient and its image gradient are computed by hand (`veil.models.vit_grads`,
  no autograd graph; the same function to float rounding, so the same signed steps); one more
  veil run with `engine=autograd` (autograd's double backward) is reported outside the ratio.
  veil runs in this process, breaching as a
  subprocess of its venv, interleaved (veil, breaching, veil, breaching, ...). Timed: the
  attack's `reconstruct` call on each side (breaching's subprocess start and imports are not).
  Differences that remain, by each library's design: breaching's TV pads the border (a conv with
  zero padding, + 1e-8 inside the abs) where veil's takes the mean of interior differences;
  breaching's first milestone is N // 2.667 (one iteration before veil's 3N // 8); breaching
  returns the best iterate by objective, veil the last.
* APRIL (Lu et al. 2022). breaching's `april_analytic` solves through the first attention layer
  and only runs on its modified first block (no LayerNorm or residual before attention), on a
  timm ViT: it is built at the same size on the breaching side and attacks its own update of the
  same image. veil's `april` (position- and patch-embedding gradients) attacks veil's ViT. veil's
  closed form is also run on breaching's modified model's update (the same update for both).

`--write` puts the table, the command, the versions and the load average the script saw into
docs/results.md between the markers <!-- ig-vs-breaching --> and <!-- /ig-vs-breaching -->.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from veil.attacks import Knowledge, create_attack, observe
from veil.attacks.analytic_vit import solve_patches
from veil.attacks.inverting import GradientTarget, total_variation
from veil.data import load_data
from veil.metrics.image import psnr
from veil.models import create_model
from veil.models.vit import unpatchify

ROOT = Path(__file__).resolve().parent.parent
SIDE = Path(__file__).resolve().parent / "_breaching_side.py"
RESULTS = ROOT / "docs" / "results.md"
BEGIN, END = "<!-- ig-vs-breaching -->", "<!-- /ig-vs-breaching -->"
MODEL = dict(image_size=32, patch_size=4, in_chans=3, dim=192, depth=6, heads=3, mlp_ratio=4.0, num_classes=2)


def load() -> float:
    return os.getloadavg()[0]


def breaching(python: str, mode: str, tensors: dict, cfg: dict, workdir: str) -> tuple[dict, dict]:
    """Run `_breaching_side.py MODE` in breaching's venv; returns its tensors and its result JSON."""
    src, dst = os.path.join(workdir, f"{mode}_in.safetensors"), os.path.join(workdir, f"{mode}_out.safetensors")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, src, metadata={"config": json.dumps(cfg)})
    threads = str(cfg["threads"])
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if cfg.get("device", "cpu") == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("PYTHONPATH", None)  # never veil's source; breaching's own path where it is not a venv
    if os.environ.get("BREACHING_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["BREACHING_PYTHONPATH"]
    proc = subprocess.run([python, str(SIDE), mode, src, dst], env=env, capture_output=True, text=True, cwd=workdir)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-5:]
        sys.exit(f"ig_vs_breaching: the breaching side failed ({mode}):\n" + "\n".join(tail))
    with safe_open(dst, framework="pt") as f:
        result = json.loads(f.metadata()["result"])
    return load_file(dst), result


def objective(
    target: GradientTarget, model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, tv: float
) -> float:
    """veil's IG objective at x (1 - cosine over every parameter + tv * TV): both results scored alike."""
    batch = {"pixels": x.detach(), "labels": labels}
    grads = target.dummy_grads(model.loss(model(batch), batch))
    return float(target.cosine(grads).detach() + tv * total_variation(x.detach()))


def run_ig(args: argparse.Namespace, model, batch: dict, obs, workdir: str) -> dict:  # noqa: ANN001
    image, labels = batch["pixels"], batch["labels"]
    x0 = torch.rand(image.shape, generator=torch.Generator().manual_seed(args.seed))  # veil's first draw
    settings = dict(iterations=args.iterations, restarts=1, lr=args.lr, tv=args.tv, layers="all", schedule="step")
    settings.update(distance="cosine", signed=True, seed=args.seed, label="infer")
    names = [n for n, _ in model.named_parameters()]
    tensors = {"image": image, "labels": labels, "x0": x0}
    tensors.update({"model." + k: v for k, v in model.state_dict().items()})
    tensors.update({"grad." + n: obs.grads[n] for n in names})
    cfg = dict(
        model=MODEL, iterations=args.iterations, lr=args.lr, tv=args.tv, threads=args.threads, device=args.device
    )
    target = GradientTarget(model, obs.grads)
    runs: dict[str, list[dict]] = {"veil": [], "breaching": []}
    warm = {**settings, "iterations": 2}  # one untimed warm-up, as each breaching subprocess makes its own
    create_attack("ig", **warm).reconstruct(obs, Knowledge(batch_size=1, labels=labels))
    for _ in range(args.repeats):
        l0 = load()
        t0, c0 = time.perf_counter(), time.process_time()
        rec = create_attack("ig", **settings).reconstruct(obs, Knowledge(batch_size=1, labels=labels))
        sec, cpu = time.perf_counter() - t0, time.process_time() - c0
        runs["veil"].append(_row(sec, cpu, args.iterations, image, rec.images, target, model, labels, args.tv, l0))
        l0 = load()
        out, res = breaching(args.breaching_python, "ig", tensors, cfg, workdir)
        sec, cpu, rec_b = res["seconds"], res["cpu_seconds"], out["reconstruction"]
        row = _row(sec, cpu, args.iterations, image, rec_b, target, model, labels, args.tv, l0)
        row.update(
            versions={k: res[k] for k in ("torch", "breaching", "python")}, update_rel_error=res["update_rel_error"]
        )
        runs["breaching"].append(row)
        v = runs["veil"][-1]
        print(
            f"  ig  veil {v['it_s']:.2f} it/s ({v['it_cpu_s']:.2f} per CPU s)  "
            f"breaching {row['it_s']:.2f} it/s ({row['it_cpu_s']:.2f} per CPU s)",
            flush=True,
        )
    # the same objective through autograd's double backward (engine=autograd): the step veil had before
    # veil.models.vit_grads, outside the ratio; the signed iterates, PSNR and objective should match veil's
    l0 = load()
    t0, c0 = time.perf_counter(), time.process_time()
    rec = create_attack("ig", **settings, engine="autograd").reconstruct(obs, Knowledge(batch_size=1, labels=labels))
    sec, cpu = time.perf_counter() - t0, time.process_time() - c0
    runs["veil_autograd"] = [_row(sec, cpu, args.iterations, image, rec.images, target, model, labels, args.tv, l0)]
    # veil's own defaults (input-layer gradients, cosine lr decay): another objective, outside the ratio
    l0 = load()
    t0, c0 = time.perf_counter(), time.process_time()
    own = dict(iterations=args.iterations, restarts=1, seed=args.seed)
    rec = create_attack("ig", **own).reconstruct(obs, Knowledge(batch_size=1, labels=labels))
    sec, cpu = time.perf_counter() - t0, time.process_time() - c0
    runs["veil_defaults"] = [_row(sec, cpu, args.iterations, image, rec.images, target, model, labels, args.tv, l0)]
    return runs


def _row(sec: float, cpu: float, its: int, image, rec, target, model, labels, tv: float, l0: float) -> dict:  # noqa: ANN001
    rec = rec.detach().clamp(0, 1)
    return {
        "seconds": sec,
        "it_s": its / sec,
        "it_cpu_s": its / cpu,
        "psnr": psnr(image.cpu(), rec.cpu()),
        "objective": objective(target, model, rec.to(image.device), labels, tv),
        "load": (l0, load()),
    }


def run_april(args: argparse.Namespace, model, batch: dict, obs, workdir: str) -> dict:  # noqa: ANN001
    image = batch["pixels"].cpu()
    attack = create_attack("april")
    veil_times, rec = [], None
    for _ in range(args.april_repeats):
        t0 = time.perf_counter()
        rec = attack.reconstruct(obs, Knowledge(batch_size=1))
        veil_times.append(time.perf_counter() - t0)
    cfg = dict(model=MODEL, seed=args.seed, repeats=args.april_repeats, threads=args.threads)
    out, res = breaching(
        args.breaching_python, "april", {"image": image, "labels": batch["labels"].cpu()}, cfg, workdir
    )
    # veil's closed form on the same update breaching attacked (its modified timm ViT's)
    G = out["grad_pos"].reshape(-1, out["grad_pos"].shape[-1])[1:]
    dW = out["grad_patch"].reshape(out["grad_patch"].shape[0], -1)
    same_times, same = [], None
    for _ in range(args.april_repeats):
        t0 = time.perf_counter()
        X = solve_patches(G, dW)
        same = unpatchify(X.unsqueeze(0), MODEL["patch_size"], MODEL["in_chans"], MODEL["image_size"]).clamp(0, 1)
        same_times.append(time.perf_counter() - t0)
    med = lambda t: statistics.median(t[1:] if len(t) > 1 else t)  # noqa: E731 - the first call pays setup
    return {
        "veil": {"seconds": med(veil_times), "psnr": psnr(image, rec.images.cpu())},
        "breaching": {"seconds": med(res["seconds"]), "psnr": psnr(image, out["reconstruction"].clamp(0, 1))},
        "cond_pos": res["cond_pos"],
        "veil_on_breaching": {"seconds": med(same_times), "psnr": psnr(image, same)},
    }


def fmt_psnr(v: float) -> str:
    return "inf" if v == float("inf") else f"{v:.2f}"


def report(args: argparse.Namespace, ig: dict, april: dict, loads: list[float], cmd: str) -> str:
    v, b = ig["veil"], ig["breaching"]  # interleaved runs of the same objective
    bv = b[0]["versions"]
    mv = statistics.median(r["it_s"] for r in v)
    mb = statistics.median(r["it_s"] for r in b)
    lines = [
        "## Inverting Gradients vs breaching",
        "",
        f"`{cmd}` (`benchmarks/ig_vs_breaching.py`; breaching in its own venv, see the script's top). "
        + ("CPU" if args.device == "cpu" else torch.cuda.get_device_name())
        + f", torch threads={args.threads} on both sides; 1-minute load average seen by the script "
        f"{min(loads):.1f}-{max(loads):.1f} (a shared machine: the runs are interleaved veil, breaching, ...). "
        f"veil: torch {torch.__version__}; breaching {bv['breaching']}: torch {bv['torch']}.",
        "",
        f"IG: veil's `vit-tiny` (patch 4, width 192, depth 6, 32x32x3, 2 classes, seed {args.seed}, at init), "
        f"one LFW test face (index {args.image}), its client update; 1 - cosine over every parameter's gradient "
        f"+ {args.tv:g} TV, signed Adam lr {args.lr:g}, x0.1 at 3/8, 5/8, 7/8, box [0, 1], the same start "
        f"image, {args.iterations} iterations, 1 restart. PSNR after the budget; objective: veil's, at each result. "
        "veil's step on its own ViT is the hand-written one (`veil.models.vit_grads`: no autograd graph, the same "
        "function to float rounding); the `engine=autograd` row is the same attack through autograd. "
        f"breaching's model reproduces veil's update to a relative error of {max(r['update_rel_error'] for r in b):.1e}.",
        "",
        "| side | run | it/s (wall) | it per CPU second | seconds | PSNR dB | objective | load (before, after) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i in range(len(v)):
        for name, r in (("veil", v[i]), ("breaching", b[i])):
            lines.append(
                f"| {name} | {i + 1} | {r['it_s']:.2f} | {r['it_cpu_s']:.2f} | {r['seconds']:.1f} | {fmt_psnr(r['psnr'])} | "
                f"{r['objective']:.3e} | {r['load'][0]:.1f}, {r['load'][1]:.1f} |"
            )
    cv = statistics.median(r["it_cpu_s"] for r in v)
    cb = statistics.median(r["it_cpu_s"] for r in b)
    d = ig["veil_autograd"][0]
    lines.append(
        "| veil, `engine=autograd` (the same objective and steps through autograd's double backward; outside "
        f"the ratio) | 1 | {d['it_s']:.2f} | {d['it_cpu_s']:.2f} | {d['seconds']:.1f} | {fmt_psnr(d['psnr'])} | "
        f"{d['objective']:.3e} | {d['load'][0]:.1f}, {d['load'][1]:.1f} |"
    )
    d = ig["veil_defaults"][0]
    lines.append(
        f"| veil, its defaults (`layers=input`, cosine lr decay; not the objective above, outside the ratio) | 1 | "
        f"{d['it_s']:.2f} | {d['it_cpu_s']:.2f} | {d['seconds']:.1f} | {fmt_psnr(d['psnr'])} | "
        f"{d['objective']:.3e} | {d['load'][0]:.1f}, {d['load'][1]:.1f} |"
    )
    pv = statistics.median(r["psnr"] for r in v)
    pb = statistics.median(r["psnr"] for r in b)
    lines += [
        "",
        f"**Median it/s: veil {mv:.2f}, breaching {mb:.2f}: ratio {mv / mb:.2f}x** (goal >= 1.5x; per CPU second, "
        f"less sensitive to the load: veil {cv:.2f}, breaching {cb:.2f}, ratio {cv / cb:.2f}x); "
        f"median PSNR: veil {fmt_psnr(pv)} dB, breaching {fmt_psnr(pb)} dB (goal: veil not lower).",
        "",
        "APRIL (closed form, batch 1, the same face; median seconds over "
        f"{args.april_repeats} calls, the first dropped):",
        "",
        "| attack | model | update | seconds | PSNR dB |",
        "|---|---|---|---|---|",
        f"| veil `april` | veil vit-tiny (pre-LN) | veil's | {april['veil']['seconds']:.4f} | "
        f"{fmt_psnr(april['veil']['psnr'])} |",
        f"| breaching `april_analytic` | timm ViT, breaching's ModifiedBlock first | breaching's | "
        f"{april['breaching']['seconds']:.4f} | {fmt_psnr(april['breaching']['psnr'])} |",
        f"| veil's closed form (`solve_patches`) | timm ViT, breaching's ModifiedBlock first | breaching's | "
        f"{april['veil_on_breaching']['seconds']:.4f} | {fmt_psnr(april['veil_on_breaching']['psnr'])} |",
        "",
        f"The condition number of dL/dE_pos on breaching's model is {april['cond_pos']:.1e}: breaching's "
        "attention solve (lstsq on it, float32 gradients) amplifies their rounding by that much; veil's solve "
        "reads the patches off dL/dW_patch = G^T X with a truncated pseudo-inverse (rcond 1e-7).",
        "",
        "Remaining differences (by each library's design): breaching's TV pads the image border; its first "
        "lr milestone falls one iteration earlier (N // 2.667); it returns its best iterate by objective, veil "
        "its last.",
    ]
    return "\n".join(lines) + "\n"


def write_section(text: str) -> None:
    doc = RESULTS.read_text()
    block = f"{BEGIN}\n{text}{END}\n"
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        doc = head + block + rest.split(END, 1)[1].lstrip("\n")
    else:
        doc = doc.rstrip("\n") + "\n\n" + block
    RESULTS.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2, help="IG runs per side, interleaved")
    ap.add_argument("--april-repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tv", type=float, default=1e-4)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", type=int, default=0, help="index of the LFW test image")
    ap.add_argument(
        "--breaching-python", default=os.environ.get("BREACHING_PYTHON", "/work/venvs/breaching/bin/python")
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="both sides on this device")
    ap.add_argument("--json", default="", help="also write the measurements to this JSON (the GPU table reads it)")
    ap.add_argument("--write", action="store_true", help="replace the section in docs/results.md")
    args = ap.parse_args()
    if not shutil.which(args.breaching_python) and not Path(args.breaching_python).exists():
        sys.exit(f"ig_vs_breaching: no breaching venv at {args.breaching_python}; make it as the script's top says")
    if args.repeats < 2 or args.iterations < 8:
        sys.exit("ig_vs_breaching: --repeats must be at least 2 and --iterations at least 8")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = create_model("vit-tiny", num_classes=MODEL["num_classes"])
    test = load_data("lfw", size=MODEL["image_size"], channels=MODEL["in_chans"]).test
    model.to(args.device)
    batch = {k: v[args.image : args.image + 1].to(args.device) for k, v in test.items()}
    obs = observe(model, batch)
    missing = [n for n, _ in model.named_parameters() if n not in obs.grads]
    if missing:
        sys.exit(f"ig_vs_breaching: the update lacks {missing[:3]}")
    model.eval()
    loads = [load()]
    with tempfile.TemporaryDirectory() as workdir:
        ig = run_ig(args, model, batch, obs, workdir)
        loads.append(load())
        april = run_april(args, model, batch, obs, workdir)
    loads += [x for side in ig.values() for r in side for x in r["load"]] + [load()]
    argv = " ".join(a for a in sys.argv[1:] if a != "--write")
    cmd = f"python benchmarks/ig_vs_breaching.py {argv}".strip()
    text = report(args, ig, april, loads, cmd)
    print(text)
    if args.json:
        gpu = torch.cuda.get_device_name() if args.device == "cuda" else ""
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": cmd,
                    "device": args.device,
                    "gpu": gpu,
                    "torch": torch.__version__,
                    "ig": ig,
                    "april": april,
                },
                indent=1,
            )
        )
    if args.write:
        write_section(text)
        print(f"written to {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
