"""PNG plots of evaluation results (matplotlib, no display needed).

- `plot_record(record, path)`: the picture of one CLI result: perplexity by position (ppl,
  on a log axis with plain-number ticks; positions no window scores are shaded and named),
  accuracy by length and depth as a heat map (passkey), accuracy by gold-document position
  as bars with their values (mdqa, one bar per position, one position included).
- `plot_stories(result, path)`: Experiment 1 (benchmarks/stories_experiment.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cca_jax.eval.common import attention_label


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def _position_curve(ax, rec: dict[str, Any], first: int = 0, **style) -> None:
    """Each bucket's perplexity at the middle of its scored positions (those >= `first`)."""
    pts = [((max(b["lo"], first) + b["hi"]) / 2, b["ppl"]) for b in rec["by_position"]
           if b["ppl"]]
    ax.plot([p for p, _ in pts], [v for _, v in pts], marker=".", **style)


def readable_log_y(ax, values) -> None:
    """A log y axis whose ticks are plain numbers (`517`, `520`; `10`, `20`, `50`, `100`),
    not `5.2 x 10^2`: 1-2-5 steps over a decade or more, else evenly spaced round numbers."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullLocator

    lo, hi = min(values), max(values)
    ax.set_yscale("log")
    if hi >= 4 * lo:
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    else:
        pad = (hi - lo) * 0.08 or abs(hi) * 0.01
        ticks = [t for t in MaxNLocator(nbins=5).tick_values(lo - pad, hi + pad)
                 if lo - pad <= t <= hi + pad and t > 0]
        ax.set_ylim(lo - pad, hi + pad)
        ax.yaxis.set_major_locator(FixedLocator(ticks or [lo]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.4g}"))
    ax.yaxis.set_minor_locator(NullLocator())


def _unscored_front(record: dict[str, Any]) -> tuple[int, int] | None:
    """Window positions `[lo, hi)` that no window scores, when the first bucket has some:
    those before `seq_len - stride` with a stride, else the empty buckets in front."""
    buckets = record["by_position"]
    lo = buckets[0]["lo"]
    if record.get("stride"):
        hi = record["seq_len"] - record["stride"]
    else:
        empty = 0
        while empty < len(buckets) - 1 and not buckets[empty]["tokens"]:
            empty += 1
        hi = buckets[empty]["lo"]
    return (lo, hi) if hi > lo else None


def plot_ppl(record: dict[str, Any], path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    unscored = _unscored_front(record)
    _position_curve(ax, record, first=unscored[1] if unscored else 0,
                    label=attention_label(record))
    readable_log_y(ax, [b["ppl"] for b in record["by_position"] if b["ppl"]])
    ax.set(xlabel="position in window (tokens)", ylabel="perplexity (log scale)",
           title=f"perplexity by position (ppl {record['ppl']:.3g} over "
                 f"{record['windows']} windows)")
    if unscored:   # shaded, and named under the axis (where no point can hide it)
        lo, hi = unscored
        why = (f" (each window scores its last {record['stride']})" if record.get("stride")
               else "")
        ax.axvspan(lo, hi, color="0.9", zorder=0)
        ax.set_xlabel(f"position in window (tokens)\nshaded: positions {lo}-{hi - 1}, not "
                      f"scored{why}")
        ax.set_xlim(left=lo)
    ax.legend()
    _save(fig, path)


def plot_passkey(record: dict[str, Any], path) -> None:
    import numpy as np

    plt = _pyplot()
    lengths, depths = record["lengths"], record["depths"]
    grid = np.full((len(depths), len(lengths)), np.nan)
    for cell in record["by_length_depth"]:
        grid[depths.index(cell["depth"]), lengths.index(cell["length"])] = cell["accuracy"]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.2 + 0.9 * len(lengths)),
                                    max(2.6, 1.0 + 0.45 * len(depths))))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        ax.text(j, i, "-" if np.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set(xlabel="prompt length (tokens)", ylabel="needle depth",
           title=f"{record['task_kind']}: {attention_label(record)}\n"
                 f"accuracy {record['accuracy']:.2f}")
    fig.colorbar(im, ax=ax, label="exact match")
    _save(fig, path)


def plot_mdqa(record: dict[str, Any], path) -> None:
    """One bar per gold-document position, its accuracy and example count written on it (a
    bar of accuracy 0 still shows its label); integer positions on the x axis."""
    plt = _pyplot()
    rows = [r for r in record.get("by_gold_position") or [] if r["gold_position"] is not None]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.5 + 0.5 * len(rows)), 3.4))
    x = [r["gold_position"] for r in rows]
    acc = [r["accuracy"] for r in rows]
    ax.bar(x, acc, width=0.6, color="C0", edgecolor="C0")
    for xi, a, r in zip(x, acc, rows):
        ax.text(xi, a + 0.02, f"{a:.2f}\nn={r['examples']}", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(x, [str(p) for p in x])
    if x:
        ax.set_xlim(min(x) - 0.7, max(x) + 0.7)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set(xlabel="position of the gold document (0-based)", ylabel="accuracy", ylim=(0, 1.3),
           title=f"{record['format']}: {attention_label(record)}\nn={record['examples']}, "
                 f"accuracy {record['accuracy']:.2f}")
    _save(fig, path)


def plot_record(record: dict[str, Any], path) -> None:
    """The picture of one `python -m cca_jax.eval` result."""
    {"ppl": plot_ppl, "passkey": plot_passkey, "mdqa": plot_mdqa}[record["task"]](record, path)


def plot_stories(result: dict[str, Any], path) -> None:
    """Experiment 1: ppl per option (swapped in vs fine-tuned) and by position."""
    import numpy as np

    plt = _pyplot()
    names = list(result["options"])
    recs = result["options"]
    fig, (bars, curve) = plt.subplots(1, 2, figsize=(13, 4.2))
    x = np.arange(len(names))
    before = [recs[n]["swapped"]["ppl"] for n in names]
    after = [recs[n]["fine_tuned"]["ppl"] for n in names]
    bars.bar(x - 0.2, before, 0.4, label="swapped in, no fine-tune")
    bars.bar(x + 0.2, after, 0.4, label=f"fine-tuned ({result['train']['steps']} steps)")
    for xi, v in zip(np.r_[x - 0.2, x + 0.2], before + after):
        bars.text(xi, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
    bars.set_xticks(x, [attention_label(recs[n]["swapped"]) for n in names], fontsize=8)
    bars.set(yscale="log", ylabel="perplexity (log)", title="held-out self-samples, 512 tokens")
    bars.legend(fontsize=8)
    for i, n in enumerate(names):
        color = f"C{i}"
        _position_curve(curve, recs[n]["swapped"], color=color, linestyle=":",
                        label=f"{attention_label(recs[n]['swapped'])}, swapped")
        _position_curve(curve, recs[n]["fine_tuned"], color=color,
                        label=f"{attention_label(recs[n]['fine_tuned'])}, fine-tuned")
    window = recs["cca"]["option"]["window_size"] if "cca" in recs else None
    if window:
        curve.axvline(window, color="grey", linewidth=0.8)
        curve.text(window, curve.get_ylim()[0], f" raw window {window}", va="bottom",
                   fontsize=7)
    curve.set(yscale="log", xlabel="position in window (tokens)", ylabel="perplexity (log)",
              title="perplexity by position")
    curve.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)
