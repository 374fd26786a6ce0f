"""The eval report: a markdown table and matplotlib figures."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    return f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def report_md(results: dict[str, Any]) -> str:
    lines = [
        f"# kvfuse eval: {results['data']}",
        "",
        f"model `{results['model']}`, {results['cases']} cases, top-{results['top_k']} chunks of at most "
        f"{results['chunk_tokens']} tokens, answers of at most {results['max_tokens']} tokens. Fidelity is "
        "teacher-forced on full's greedy answer; KL is KL(full ‖ method) per answer token.",
        "",
        "| method | F1 | Rouge-L | first-token agr. | token agr. | KL | answer agr. F1 | TTFT median (s) | "
        "TTFT mean (s) | TTFT / full | recomputed | n |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in results["methods"].items():
        if not m.get("n"):
            lines.append(f"| {name} | errors: {m.get('errors', 0)} |" + " |" * 10)
            continue
        shown = f"**{name}** (recommended)" if name == "default" else name
        lines.append(
            f"| {shown} | {_fmt(m['f1'])} | {_fmt(m['rouge_l'])} | {_fmt(m['first_token_agreement'])} | "
            f"{_fmt(m['token_agreement'])} | {_fmt(m['kl'], 4)} | {_fmt(m['answer_agreement_f1'])} | "
            f"{_fmt(m['ttft_s_median'])} | {_fmt(m['ttft_s_mean'])} | {_fmt(m['ttft_ratio_to_full_median'])} | "
            f"{_fmt(m['recomputed_fraction'])} | {m['n']} |"
        )
    recommended = _recommended(results)
    if recommended:
        lines += ["", recommended]
    return "\n".join(lines) + "\n"


def _recommended(results: dict[str, Any]) -> str | None:
    """What the `default` row ran: the default fuser, and its ratios (calibrated, or its default)."""
    runs = [c["methods"]["default"] for c in results.get("per_case", []) if "fuser" in c["methods"].get("default", {})]
    if not runs:
        return None
    ratios = sorted({round(r["ratio"], 4) for r in runs if r.get("ratio") is not None})
    shown = ", ".join(str(r) for r in ratios) if ratios else "none"
    return (f"The recommended row, `default`, is the default mode `{runs[0]['fuser']}` at ratio {shown} "
            "(its calibrated floor when the model is calibrated, else its default ratio).")


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def quality_vs_ttft(results: dict[str, Any], path: Path) -> Path:
    """Each method as a point: TTFT median against gold F1 (left) and token agreement with full (right)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    quality = "rouge_l" if _summaries(results) else "f1"
    for name, m in results["methods"].items():
        if not m.get("n"):
            continue
        for ax, key in zip(axes, (quality, "token_agreement"), strict=True):
            ax.scatter(m["ttft_s_median"], m[key])
            ax.annotate(name, (m["ttft_s_median"], m[key]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    axes[0].set_ylabel("Rouge-L" if quality == "rouge_l" else "gold F1")
    axes[1].set_ylabel("token agreement with full")
    for ax in axes:
        ax.set_xlabel("TTFT median (s)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{results['cases']} cases, {results['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fidelity_vs_ttft(results: dict[str, Any], path: Path) -> Path | None:
    """Every fuser and ratio on one plot: KL(full || method) against TTFT as a share of full's, one line
    per fuser (its ratios in order), and the Pareto front (no other point is both cheaper and closer)."""
    pts = [(n, m["ttft_ratio_to_full_median"], m["kl"]) for n, m in results["methods"].items()
           if m.get("n") and n != "full" and m.get("ttft_ratio_to_full_median") is not None and m.get("kl") is not None]
    if not pts:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    families: dict[str, list[tuple[float, float, str]]] = {}
    for name, x, y in pts:
        families.setdefault(re.sub(r"@[^:]*", "", name), []).append((x, y, name))  # a fuser with its options
    for fam, xs in sorted(families.items()):
        xs.sort()
        ax.plot([x for x, _, _ in xs], [max(y, 1e-6) for _, y, _ in xs], "o-", label=fam)
        for x, y, name in xs:
            ax.annotate(name, (x, max(y, 1e-6)), textcoords="offset points", xytext=(4, 4), fontsize=7)
    front = [p for p in pts if not any(q[1] <= p[1] and q[2] <= p[2] and q != p for q in pts)]
    front.sort(key=lambda p: p[1])
    ax.plot([p[1] for p in front], [max(p[2], 1e-6) for p in front], "k--", lw=1, label="Pareto front")
    ax.set_yscale("log")
    ax.set_xlabel("TTFT / full's (median of per-case ratios)")
    ax.set_ylabel("KL(full ‖ method), teacher-forced")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"{results['cases']} cases, {results['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _summaries(results: dict[str, Any]) -> bool:
    words = [len(a.split()) for c in results["per_case"] for a in c["answers"]]
    return bool(words) and sum(words) / len(words) > 20


def blend_ratios(results: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    out = []
    for name, m in results["methods"].items():
        base, _, arg = name.partition("@")
        if base == "blend" and m.get("n"):
            try:
                out.append((float(arg), m))
            except ValueError:
                continue
    return sorted(out, key=lambda x: x[0])


def ratio_sensitivity(results: dict[str, Any], path: Path) -> Path | None:
    """Fidelity and TTFT against the blend ratio, when at least two numeric ratios were run."""
    points = blend_ratios(results)
    if len(points) < 2:
        return None
    plt = pyplot()
    r = [p[0] for p in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(r, [p[1]["first_token_agreement"] for p in points], "o-", label="first-token agreement")
    a.plot(r, [p[1]["token_agreement"] for p in points], "s-", label="token agreement")
    a.set_xlabel("recompute ratio")
    a.set_ylabel("agreement with full")
    a2 = a.twinx()
    a2.plot(r, [p[1]["kl"] for p in points], "^--", color="gray", label="KL")
    a2.set_ylabel("KL(full ‖ blend)")
    a.legend(loc="lower right", fontsize=8)
    b.plot(r, [p[1]["ttft_s_median"] for p in points], "o-", label="blend")
    full = results["methods"].get("full")
    if full and full.get("n"):
        b.axhline(full["ttft_s_median"], color="red", ls="--", label="full")
    b.set_xlabel("recompute ratio")
    b.set_ylabel("TTFT median (s)")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
