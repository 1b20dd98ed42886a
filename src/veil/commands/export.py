"""`veil export RUN_DIR --hf DIR`: a trained run of a Hugging Face family written back as a
Hugging Face checkpoint folder.

The run's trained weights go out with ``save_pretrained`` (safetensors) and, for text, the data's
tokenizer beside them, so DIR loads in transformers (``AutoModelFor...from_pretrained(DIR)``) and
in veil as ``model: {name: hf, path: DIR}``. Runs of ``hf`` (any family), ``minilm``, ``hf-bert``,
``hf-gpt2`` and ``hf-vit`` export; veil's own presets have no Hugging Face layout (one line).
What a defense adds to the model (MJP's E_unk, AEGIS's frozen set) is not part of the checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from veil.commands import subcommand
from veil.errors import VeilError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = subcommand(sub, "export", "write a trained run as a Hugging Face checkpoint folder (--hf DIR)", __doc__, run)
    p.add_argument("run_dir", help="a run folder written by `veil train` (or federate / split)")
    p.add_argument(
        "--hf", required=True, metavar="DIR", help="the folder to write (config.json, model.safetensors, tokenizer)"
    )


def run(args: argparse.Namespace) -> int:
    from veil.build import load_run
    from veil.models.hf_path import save_hf

    out = Path(args.hf)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise VeilError(f"--hf '{out}' exists and is not an empty folder; name a new one")
    cfg, model, data, _ = load_run(args.run_dir)
    tokenizer = None
    if model.modality == "text":
        tok = data.meta.get("tokenizer")
        if tok is None or not hasattr(tok, "hf_tokenizer"):
            raise VeilError(
                f"run '{args.run_dir}' was tokenized with {getattr(tok, 'name', 'a tokenizer')!r}, which is not a Hugging Face "
                "tokenizer; export runs trained with data.tokenizer=wordpiece or a model folder's tokenizer"
            )
        tokenizer = tok.hf_tokenizer()
    save_hf(model, out, tokenizer)
    print(f"wrote {out} ({cfg.model['name']}: load it with model: {{name: hf, path: {out}}})")
    return 0
