"""The breaching side of `benchmarks/ig_vs_breaching.py`: runs in breaching's own virtualenv.

It imports torch, safetensors, breaching (and, for APRIL, timm), never veil: breaching 0.1.2 wants
torchvision and hydra-core beside a torch that veil's pinned CPU wheel is not. It is started as a
subprocess by the veil side, once per measurement:

    python _breaching_side.py ig    IN.safetensors OUT.safetensors
    python _breaching_side.py april IN.safetensors OUT.safetensors

IN holds the tensors and a JSON "config" in its metadata (written by the veil side); OUT holds the
reconstruction and a JSON "result" (wall time, iterations, library versions).

* ig: `PlainViT` below is veil's ViT (`veil.models.vit.ViT` with `veil.models.blocks.Block`,
  pre-LN, eager attention with separate Q/K/V/O linears) in plain torch, with the same parameter
  names, so veil's state dict loads into it unchanged. breaching's stock `invertinggradients`
  attack (Geiping et al. 2020: cosine gradient distance over every parameter + total variation,
  signed Adam, box [0, 1], step decay) attacks veil's client update of the image, from the same
  starting image, for the same iteration budget.
* april: breaching's `april_analytic` attack (Lu et al. 2022) needs its modified first block
  (`ModifiedBlock`: no LayerNorm and no residual before the first attention) on a timm ViT; it
  is built here at the same size and attacks this model's own update of the same image. The
  gradients of its position and patch embeddings come back too, so that veil's closed form can
  be run on the very same update.
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
from safetensors.torch import load_file, safe_open, save_file
from torch import Tensor, nn


class Table(nn.Module):
    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        split = lambda t: t.view(B, T, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        att = (q @ k.transpose(-2, -1) / math.sqrt(D // self.heads)).softmax(dim=-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PlainViT(nn.Module):
    """veil's ViT forward: linear patch embedding, [CLS] + learned positions, pre-LN blocks, head."""

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        in_chans: int,
        dim: int,
        depth: int,
        heads: int,
        mlp_ratio: float,
        num_classes: int,
    ) -> None:
        super().__init__()
        self.p = patch_size
        n = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(in_chans * patch_size**2, dim)
        self.cls = Table(1, dim)
        self.pos = Table(n + 1, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, int(dim * mlp_ratio)) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        p = self.p
        patches = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)
        tok = self.patch_embed(patches) + self.pos.weight[1:].unsqueeze(0)
        cls = (self.cls.weight + self.pos.weight[:1]).expand(B, 1, -1)
        h = torch.cat([cls, tok], dim=1)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h)[:, 0])


class Metadata:
    """breaching's data description (the fields its attacks read): no mean/std, so the box is [0, 1]."""

    modality = "vision"

    def __init__(self, shape: tuple[int, ...], classes: int) -> None:
        self.shape = shape
        self.classes = classes
        self.size = (1,)
        self.normalize = False


def read(path: str) -> tuple[dict[str, Tensor], dict]:
    with safe_open(path, framework="pt") as f:
        cfg = json.loads(f.metadata()["config"])
    return load_file(path), cfg


def versions() -> dict[str, str]:
    from importlib.metadata import version

    import breaching  # noqa: F401 - imported for its presence

    return {"torch": torch.__version__, "breaching": version("breaching"), "python": sys.version.split()[0]}


def payload(model: nn.Module, meta: Metadata, grads: list[Tensor], labels: Tensor) -> tuple[list, list]:
    server = [dict(parameters=list(model.parameters()), buffers=list(model.buffers()), metadata=meta)]
    shared = [
        dict(gradients=grads, buffers=None, metadata=dict(num_data_points=1, labels=labels, local_hyperparams=None))
    ]
    return server, shared


def run_ig(t: dict[str, Tensor], cfg: dict) -> tuple[dict[str, Tensor], dict]:
    import breaching

    m, dev = cfg["model"], torch.device(cfg.get("device", "cpu"))
    t = {k: v.to(dev) for k, v in t.items()}
    model = PlainViT(**m).eval()
    model.load_state_dict({k[len("model.") :]: v for k, v in t.items() if k.startswith("model.")}, strict=True)
    model.to(dev)
    image, labels, x0 = t["image"], t["labels"], t["x0"]
    names = [n for n, _ in model.named_parameters()]
    grads = [t["grad." + n] for n in names]
    # The same update as veil's? Recompute it with this module: a check that the two models agree.
    loss = nn.functional.cross_entropy(model(image), labels)
    own = torch.autograd.grad(loss, list(model.parameters()))
    rel = max(float((a - b).norm() / (b.norm() + 1e-30)) for a, b in zip(own, grads))

    attack = breaching.get_attack_config("invertinggradients")
    attack.optim.max_iterations = int(cfg["iterations"])
    attack.optim.step_size = float(cfg["lr"])
    attack.optim.callback = int(cfg["iterations"]) + 1  # no log line inside the timed loop
    attack.regularization.total_variation.scale = float(cfg["tv"])
    attack.restarts.num_trials = 1
    setup = dict(device=dev, dtype=torch.float)
    attacker = breaching.attacks.prepare_attack(model, nn.CrossEntropyLoss(), attack, setup)
    server, shared = payload(model, Metadata(tuple(image.shape[1:]), m["num_classes"]), grads, labels)
    attacker.reconstruct(server, shared, {}, initial_data=x0.clone(), dryrun=True)  # warm-up: one step, untimed
    sync(dev)
    t0, c0 = time.perf_counter(), time.process_time()
    rec, _ = attacker.reconstruct(server, shared, {}, initial_data=x0.clone(), dryrun=False)
    sync(dev)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    result = {"seconds": seconds, "cpu_seconds": cpu, "iterations": int(cfg["iterations"]), "update_rel_error": rel}
    return {"reconstruction": rec["data"].detach().cpu().contiguous()}, result


def sync(dev: torch.device) -> None:
    """Wait for the GPU's queued work (a timer read before it would time the launches only)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def april_model(cfg: dict) -> nn.Module:
    """breaching's `vit_small_april` recipe (a timm ViT, first block replaced) at veil's size."""
    from breaching.cases.models.model_preparation import ModifiedBlock, VisionContainer
    from timm.models.vision_transformer import VisionTransformer

    m = cfg["model"]
    torch.manual_seed(int(cfg["seed"]))
    vit = VisionTransformer(
        img_size=m["image_size"],
        patch_size=m["patch_size"],
        in_chans=m["in_chans"],
        num_classes=m["num_classes"],
        embed_dim=m["dim"],
        depth=m["depth"],
        num_heads=m["heads"],
        mlp_ratio=m["mlp_ratio"],
    )
    # ModifiedBlock reads the `drop_path` of the timm releases breaching was written against; timm
    # 1.x names it drop_path1 / drop_path2 (identities at drop rate 0, as here): the same module.
    vit.blocks[0].drop_path = nn.Identity()
    vit.blocks[0] = ModifiedBlock(vit.blocks[0])
    return VisionContainer(vit).eval()


def run_april(t: dict[str, Tensor], cfg: dict) -> tuple[dict[str, Tensor], dict]:
    import breaching

    model = april_model(cfg)
    image, labels = t["image"], t["labels"]
    loss = nn.functional.cross_entropy(model(image), labels)
    grads = list(torch.autograd.grad(loss, list(model.parameters())))
    named = dict(zip([n for n, _ in model.named_parameters()], grads))
    attack = breaching.get_attack_config("april_analytic")
    setup = dict(device=torch.device("cpu"), dtype=torch.float)
    attacker = breaching.attacks.prepare_attack(model, nn.CrossEntropyLoss(), attack, setup)
    server, shared = payload(model, Metadata(tuple(image.shape[1:]), cfg["model"]["num_classes"]), grads, labels)
    times, rec = [], None
    for _ in range(int(cfg["repeats"])):
        t0 = time.perf_counter()
        rec, _ = attacker.reconstruct(server, [dict(s) for s in shared], {}, dryrun=False)
        times.append(time.perf_counter() - t0)
    # APRIL's attention solve is least squares in dL/dE_pos: its conditioning bounds what float32 allows
    sv = torch.linalg.svdvals(named["model.pos_embed"].squeeze(0).double())
    out = {
        "reconstruction": rec["data"].detach().contiguous(),
        "grad_pos": named["model.pos_embed"].contiguous(),
        "grad_patch": named["model.patch_embed.proj.weight"].contiguous(),
    }
    return out, {"seconds": times, "cond_pos": float(sv[0] / sv[-1])}


def main() -> None:
    mode, src, dst = sys.argv[1:4]
    tensors, cfg = read(src)
    torch.set_num_threads(int(cfg["threads"]))
    runner = {"ig": run_ig, "april": run_april}[mode]
    out, result = runner(tensors, cfg)
    result.update(versions(), threads=torch.get_num_threads())
    save_file(out, dst, metadata={"result": json.dumps(result)})


if __name__ == "__main__":
    main()
