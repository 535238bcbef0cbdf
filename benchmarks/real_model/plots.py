"""Plots of the real-model experiment, drawn from its records alone."""

from __future__ import annotations

from pathlib import Path

STYLE = {"full": "tab:blue", "cca": "tab:red", "cca_qkv": "tab:orange",
         "cca_sinks": "tab:purple", "sliding": "tab:green", "streaming": "tab:brown",
         "original": "black"}


def _color(variant: str) -> str:
    base = variant.rsplit("_", 1)[0] if variant != "original" else variant
    return STYLE.get(base, "gray")


def plot_all(records: list[dict], out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    written = []
    for fn in (_ppl_by_position, _passkey, _loss):
        path = fn(records, out)
        if path is not None:
            written.append(path)
    return written


def _save(fig, out: Path, suffix: str) -> Path:
    """Write `fig` to `<out><suffix>.png` and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = out.with_name(out.name + suffix + ".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ppl_by_position(records, out):
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = [r for r in records if r["metric"] in ("ppl_code", "ppl_book") and
            r.get("by_position")]
    if not rows:
        return None
    longest = max(r["context"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, metric in zip(axes, ("ppl_code", "ppl_book")):
        for r in rows:
            if r["metric"] != metric or r["context"] != longest:
                continue
            pts = [(b["lo"], b["ppl"]) for b in r["by_position"] if b.get("ppl")]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=_color(r["variant"]),
                    linestyle="-" if r["variant"].endswith("_ft") else "--",
                    label=f"{r['variant']} ({r['value']:.2f})", linewidth=1.2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_xlabel("position in the window (tokens)")
        ax.set_ylabel("perplexity of the positions' chunk")
        ax.set_title(f"{metric} by position, windows of {longest}")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("solid: fine-tuned; dashed: swapped in without training", fontsize=9)
    return _save(fig, out, "_ppl_position")


def _passkey(records, out):
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in records if r["metric"] == "passkey_acc" and r.get("by_depth")]
    if not rows:
        return None
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cols = min(4, len(variants))
    nrows = -(-len(variants) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.4 * cols, 2.9 * nrows), squeeze=False)
    for ax in axes.flat[len(variants):]:
        ax.axis("off")
    for ax, variant in zip(axes.flat, variants):
        mine = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["context"])
        depths = sorted({float(d) for r in mine for d in r["by_depth"]})
        grid = np.array([[r["by_depth"].get(f"{d:g}", np.nan) for r in mine] for d in depths])
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(mine)), [f"{r['context'] // 1024}K" for r in mine])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        for (i, j), acc in np.ndenumerate(grid):
            ax.text(j, i, f"{acc:.2f}", ha="center", va="center", fontsize=7)
        ax.set_title(variant, fontsize=9)
        ax.set_xlabel("context")
        ax.set_ylabel("depth")
    fig.suptitle("passkey retrieval accuracy by context and depth", fontsize=10)
    return _save(fig, out, "_passkey")


def _loss(records, out):
    import matplotlib.pyplot as plt

    rows = [r for r in records if r["metric"] == "train_tokens_per_s" and r.get("loss_curve")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        steps, losses = zip(*r["loss_curve"])
        ax.plot(steps, losses, color=_color(r["variant"]), label=r["variant"], linewidth=1.0)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("fine-tuning loss (same rows, same order)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "_loss")
