"""How the report writes numbers and settings: digits that match the evidence behind them.

- a metric: counts (patches, tokens moved, samples) as integers, PSNR in dB to one decimal with an
  exact copy written "exact (∞)", shares and scores to three decimals (`metric`);
- a mean over seeds: "± std" only where more than one seed stood behind it (`mean_std`);
- a step-time ratio to two significant digits, with the spread of the repeated steps where the
  summary records it (`ratio`);
- the attacker's knowledge and the seeds as a sentence (`knowledge_text`, `seeds_text`).
"""

from __future__ import annotations

import math
from typing import Any

#: metrics that count things (patches, tokens, samples): printed as integers when whole
COUNTS = ("masked_patches", "moved_patches", "moved_tokens", "samples", "batch_size", "presence_guesses")
EXACT = "exact (∞)"
MISSING = "—"


def _float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def metric(key: str, v: Any) -> str:
    """One metric's value as a table cell (see the module doc); text and missing values as given."""
    x = _float(v)
    if x is None:
        return MISSING if v is None else str(v)
    if math.isnan(x):
        return MISSING
    if key.startswith("psnr") and not key.endswith("_exact"):
        return EXACT if math.isinf(x) else f"{x:.1f}"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if key in COUNTS:
        return f"{x:.0f}" if x == round(x) else f"{x:.1f}"
    if key == "seconds":
        return _two(x) if x < 100 else f"{x:.0f}"
    return f"{x:.3f}" if abs(x) < 1000 else f"{x:.0f}"


def mean_std(mean: float, std: float, n: int, digits: int = 3) -> str:
    """`0.928` from one seed, `0.928 ± 0.004` from several."""
    return f"{mean:.{digits}f}" if n <= 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def ratio(r: Any, spread: Any = None) -> str:
    """A step-time ratio to two significant digits (`1.1×`), with its spread where recorded
    (`spread` = (low, high), e.g. the quartiles over the repeated steps: `1.1× (1.0-1.2)`)."""
    x = _float(r)
    if x is None or math.isnan(x):
        return MISSING
    text = f"{_two(x)}×"
    if isinstance(spread, (list, tuple)) and len(spread) == 2 and all(_float(s) is not None for s in spread):
        text += f" ({_two(float(spread[0]))}-{_two(float(spread[1]))})"
    return text


def _two(x: float) -> str:
    """Two significant digits, the trailing zero kept: 1.0, 1.1, 0.99, 12, 150."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    digits = max(1 - math.floor(math.log10(abs(x))), 0)
    return f"{round(x, digits):.{digits}f}"


def seconds(s: Any) -> str:
    """Seconds to two significant digits: `0.0085 s`, `3.1 s`, `150 s`."""
    x = _float(s)
    if x is None or math.isnan(x):
        return MISSING
    return f"{_two(x)} s" if x < 100 else f"{x:.0f} s"


def _count(n: int, one: str, many: str) -> str:
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
    return f"{words.get(n, str(n))} {one if n == 1 else many}"


def seeds_text(seeds: Any) -> str:
    """`one seed (0)`, `three seeds (0, 1, 2)`."""
    seeds = list(seeds) if isinstance(seeds, (list, tuple)) else [seeds]
    return f"{_count(len(seeds), 'seed', 'seeds')} ({', '.join(str(s) for s in seeds)})"


def knowledge_text(k: dict[str, Any] | None) -> str:
    """The scenario's `knowledge` as a sentence: `The attacker knows the batch size (1), not the labels.`"""
    k = dict(k or {})
    knows, not_known = [], []
    if "batch_size" in k:
        (knows if k["batch_size"] else not_known).append(
            f"the batch size ({k['batch_size']})" if k["batch_size"] else "the batch size"
        )
    if "labels" in k:
        (knows if k["labels"] else not_known).append("the labels")
    if "seq_len" in k:
        (knows if k["seq_len"] else not_known).append(
            f"the sequence length ({k['seq_len']})" if k["seq_len"] else "the sequence length"
        )
    if "defense" in k:
        d = k["defense"]
        if d:
            knows.append("the defense's mechanism" + (f" ({', '.join(map(str, d))})" if isinstance(d, dict) else ""))
        else:
            not_known.append("the defense's mechanism")
    for key in sorted(set(k) - {"batch_size", "labels", "seq_len", "defense"}):
        (knows if k[key] else not_known).append(key.replace("_", " "))
    if not knows and not not_known:
        return "The attacker knows what each attack's own line says (no scenario-wide knowledge given)."
    text = "The attacker knows " + _join(knows) if knows else "The attacker does not know " + _join(not_known, "or")
    if knows and not_known:
        text += ", not " + _join(not_known, "or")
    return text + "."


def _join(items: list[str], conj: str = "and") -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" {conj} " + items[-1]
