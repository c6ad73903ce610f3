"""`xrec eval --dtype bfloat16`: how far a generative model's bfloat16 ranking is from its
float32 one, per user and in the metrics, and whether issue 23's quality gate holds
(HR@10 and NDCG@10 within 1% relative of float32, top-10 overlap >= 0.95)."""

from __future__ import annotations

import numpy as np

__all__ = ["GATE", "agreement", "agreement_table"]

# the quality gate "auto" must pass before it may pick bfloat16 on a CPU (issue 23)
GATE = {"max_relative_difference": 0.01, "min_top10_overlap": 0.95}


def agreement(reference: np.ndarray, other: np.ndarray, reference_metrics: dict,
              other_metrics: dict, k: int = 10) -> dict:
    """`reference` (float32) and `other` (e.g. bfloat16) rankings, int [U, K] best first with
    -1 padding, and their metrics: the share of users whose first item is the same, the
    mean |top-k ∩ top-k| / k, the relative differences (other - reference) / reference
    of HR@10 and NDCG@10 (0 where both are equal, None where only the reference is 0),
    and whether the gate holds."""
    if reference.shape != other.shape or reference.shape[1] < k:
        raise ValueError(f"rankings: got shapes {reference.shape} and {other.shape}, expected the "
                         f"same [U, K] with K >= {k}")
    num_users = len(reference)
    top1 = float(np.mean(reference[:, 0] == other[:, 0])) if num_users else float("nan")
    overlaps = [len((set(a[:k].tolist()) & set(b[:k].tolist())) - {-1}) / k
                for a, b in zip(reference, other)]
    overlap = float(np.mean(overlaps)) if overlaps else float("nan")
    differences = {f"{m}_relative_difference": _relative(other_metrics[m], reference_metrics[m])
                   for m in ("hr@10", "ndcg@10")}
    is_close = all(d is not None and abs(d) <= GATE["max_relative_difference"]
                   for d in differences.values())
    return {"users": num_users, "top1_equal": top1, f"top{k}_overlap": overlap, **differences,
            "meets_gate": bool(is_close and overlap >= GATE["min_top10_overlap"])}


def _relative(value: float, reference: float) -> float | None:
    """(value - reference) / reference; 0 for equal values, 0 included (two models that both
    miss every target agree: the gate failed them on None)."""
    if value == reference:
        return 0.0
    return None if not reference else (value - reference) / reference


def agreement_table(agreements: dict[str, dict], metrics: dict[str, dict],
                    seconds: dict[str, float]) -> str:
    """Markdown: per model, its float32 and bfloat16 HR@10 / NDCG@10 and seconds side by
    side, with the agreement figures (`agreements`: model -> `agreement`'s result and
    "row", the bfloat16 row's name in `metrics` and `seconds`)."""
    lines = ["| model | top-1 equal | top-10 overlap | HR@10 float32 | HR@10 bfloat16 | "
             "relative | NDCG@10 float32 | NDCG@10 bfloat16 | relative | seconds float32 | "
             "seconds bfloat16 | gate |", "|---" * 12 + "|"]
    for name, a in agreements.items():
        base, other = metrics[name], metrics[a["row"]]
        cells = [name, f"{a['top1_equal']:.3f}", f"{a['top10_overlap']:.3f}",
                 f"{base['hr@10']:.4f}", f"{other['hr@10']:.4f}",
                 _percent(a["hr@10_relative_difference"]), f"{base['ndcg@10']:.4f}",
                 f"{other['ndcg@10']:.4f}", _percent(a["ndcg@10_relative_difference"]),
                 f"{seconds[name]:,.1f}", f"{seconds[a['row']]:,.1f}",
                 "holds" if a["meets_gate"] else "fails"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "" if value is None else f"{value:+.2%}"
