"""The real-model experiment's results: one merged JSON of records, a markdown report, plots.

Records from any number of runs are merged by (variant, metric, context): a newer run of the
same measurement replaces the older one, so variants measured in different sessions sit in
one table. The report states each target of the experiment and whether it was met, from the
records alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.real_model.settings import VARIANTS

KEY = ("variant", "metric", "context")
TABLE_METRICS = ("ppl_code", "ppl_book", "passkey_acc", "kv_acc", "train_tokens_per_s",
                 "ttft_s", "decode_ms_per_token")


def merge(existing: list[dict], new: list[dict]) -> list[dict]:
    """`existing` with `new` records added; a new record replaces one of the same key."""
    keyed = {tuple(r[k] for k in KEY): r for r in existing}
    for r in new:
        keyed[tuple(r[k] for k in KEY)] = r
    order = {name: i for i, name in enumerate(VARIANTS)}
    return sorted(keyed.values(), key=lambda r: (order.get(r["variant"], 99), r["metric"],
                                                 r["context"] or 0))


def value(records: list[dict], variant: str, metric: str, context: int) -> float | None:
    for r in records:
        if (r["variant"], r["metric"], r["context"]) == (variant, metric, context):
            return r["value"]
    return None


def _fmt(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    if metric.startswith("ppl"):
        return f"{v:.3f}"
    if metric.endswith("_acc"):
        return f"{v:.2f}"
    if metric == "train_tokens_per_s":
        return f"{v:,.0f}"
    return f"{v:.3g}"


def tables(records: list[dict]) -> list[str]:
    """One table per metric: variants as rows, contexts as columns."""
    lines = []
    variants = [v for v in VARIANTS if any(r["variant"] == v for r in records)]
    for metric in TABLE_METRICS:
        rows = [r for r in records if r["metric"] == metric]
        if not rows:
            continue
        contexts = sorted({r["context"] for r in rows})
        lines += [f"### {metric}", "",
                  "| variant | " + " | ".join(str(c) for c in contexts) + " |",
                  "|---" * (len(contexts) + 1) + "|"]
        for v in variants:
            cells = [_fmt(metric, value(records, v, metric, c)) for c in contexts]
            if any(c != "-" for c in cells):
                lines.append(f"| {v} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def targets(records: list[dict], long: int, short: int) -> list[str]:
    """The experiment's claims (the issue's targets), each met, missed or not yet measured."""
    def get(variant, metric, context=long):
        return value(records, variant, metric, context)

    out = []

    def claim(text: str, ok: bool | None, detail: str) -> None:
        mark = {True: "met", False: "MISSED", None: "not measured yet"}[ok]
        out.append(f"- {text}: **{mark}** ({detail})")

    for text_kind in ("code", "book"):
        m = f"ppl_{text_kind}"
        a, b = get("full_ft", m), get("cca_ft", m)
        d, e = get("sliding_ft", m), get("streaming_ft", m)
        claim(f"cca_ft {m} at {long} within 5% of full_ft",
              None if None in (a, b) else b <= 1.05 * a,
              f"cca_ft {_fmt(m, b)}, full_ft {_fmt(m, a)}"
              + (f", ratio {b / a:.3f}" if None not in (a, b) else ""))
        claim(f"cca_ft {m} at {long} below sliding_ft and streaming_ft",
              None if None in (b, d, e) else (b < d and b < e),
              f"cca_ft {_fmt(m, b)}, sliding_ft {_fmt(m, d)}, streaming_ft {_fmt(m, e)}")
        swap = get("cca_swap", m)
        if None in (a, b, swap) or swap == a:
            claim(f"cca_ft closes >= 80% of its swapped-in {m} gap", None, "needs cca_swap, "
                  "cca_ft and full_ft")
        else:
            closed = (swap - b) / (swap - a)
            claim(f"cca_ft closes >= 80% of its swapped-in {m} gap", closed >= 0.8,
                  f"(swap {swap:.3f} - cca_ft {b:.3f}) / (swap - full_ft {a:.3f}) = "
                  f"{closed:.2f}")
    pa, pb = get("full_ft", "passkey_acc"), get("cca_ft", "passkey_acc")
    claim(f"cca_ft passkey at {long} >= 90% of full_ft's",
          None if None in (pa, pb) else pb >= 0.9 * pa,
          f"cca_ft {_fmt('passkey_acc', pb)}, full_ft {_fmt('passkey_acc', pa)}")
    pd, pe = get("sliding_ft", "passkey_acc"), get("streaming_ft", "passkey_acc")
    claim(f"cca_ft passkey at {long} above sliding_ft and streaming_ft",
          None if None in (pb, pd, pe) else (pb > pd and pb > pe),
          f"sliding_ft {_fmt('passkey_acc', pd)}, streaming_ft {_fmt('passkey_acc', pe)}")
    for text_kind in ("book", "code"):
        m = f"ppl_{text_kind}"
        o, b = get("original", m, short), get("cca_ft", m, short)
        claim(f"cca_ft {m} at {short} within 3% of the original model's",
              None if None in (o, b) else b <= 1.03 * o,
              f"cca_ft {_fmt(m, b)}, original {_fmt(m, o)}")
    ta, tb = get("full_ft", "train_tokens_per_s"), get("cca_ft", "train_tokens_per_s")
    claim(f"cca_ft trains at >= 2x full_ft's tokens/s at {long}",
          None if None in (ta, tb) else tb >= 2 * ta,
          f"cca_ft {_fmt('train_tokens_per_s', tb)}, full_ft {_fmt('train_tokens_per_s', ta)}"
          + (f", {tb / ta:.2f}x" if None not in (ta, tb) else ""))
    out += _sink_targets(get, long, short)
    return out


def _sink_targets(get, long: int, short: int) -> list[str]:
    """CCA with sinks (SPEC 6): swapped in near full attention; fine-tuned no worse than CCA."""
    out = []

    def claim(text: str, ok: bool | None, detail: str) -> None:
        mark = {True: "met", False: "MISSED", None: "not measured yet"}[ok]
        out.append(f"- {text}: **{mark}** ({detail})")

    m = "ppl_book"
    full, sinks = get("full_swap", m, short), get("cca_sinks_swap", m, short)
    claim(f"cca_sinks_swap {m} at {short} within 10% of full_swap's (both at the raised theta)",
          None if None in (full, sinks) else sinks <= 1.1 * full,
          f"cca_sinks_swap {_fmt(m, sinks)}, full_swap {_fmt(m, full)}"
          + (f", ratio {sinks / full:.3f}" if None not in (full, sinks) else ""))
    for m in ("ppl_code", "ppl_book"):
        plain, sinks = get("cca_ft", m), get("cca_sinks_ft", m)
        claim(f"cca_sinks_ft {m} at {long} at or below cca_ft's",
              None if None in (plain, sinks) else sinks <= plain,
              f"cca_sinks_ft {_fmt(m, sinks)}, cca_ft {_fmt(m, plain)}")
    plain, sinks = get("cca_ft", "passkey_acc"), get("cca_sinks_ft", "passkey_acc")
    claim(f"cca_sinks_ft passkey at {long} no worse than cca_ft's",
          None if None in (plain, sinks) else sinks >= plain,
          f"cca_sinks_ft {_fmt('passkey_acc', sinks)}, cca_ft {_fmt('passkey_acc', plain)}")
    return out


def setup_lines(setup: dict[str, Any] | None) -> list[str]:
    if not setup:
        return []
    s, corpus = setup["settings"], setup.get("corpus", {})
    train = corpus.get("train", {})
    held = corpus.get("heldout", {})
    return [
        f"- model: `{setup.get('gguf')}` (sha256 `{setup.get('gguf_sha256')}`), "
        f"{setup.get('parameters', 0):,} parameters, dequantized to float32",
        f"- context extension: {s['native_context']} -> {s['seq_len']} tokens, RoPE theta "
        f"1e5 -> {s['rope_theta']:g} for every variant but `original`",
        f"- fine-tuning (every `_ft` variant): {s['steps']} steps x {s['batch_size']} rows x "
        f"{s['seq_len']} tokens = {setup['train_tokens_per_variant']:,} tokens, the same "
        f"rows in the same order; AdamW lr {s['lr']:g} after {s['warmup_steps']} warm-up "
        f"steps, then constant; {s['param_dtype']} parameters, {s['dtype']} activations; "
        "rows attend across their documents (`--no-document-mask`)",
        f"- attention: cca g = {s['group_size']}, s = {s['window_size']}; sliding W = "
        f"{s['window_size']}; streaming and cca_sinks N = {s['sink_tokens']}",
        f"- training corpus: {train.get('packages')} installed Python packages of "
        f"`{corpus.get('site_packages')}`, {train.get('documents')} documents, "
        f"{train.get('tokens', 0):,} tokens (sha256 `{train.get('sha256')}`)",
        f"- held-out code: {', '.join(p['name'] + ' ' + p['version'] for p in held.get('packages', []))}"
        f", {held.get('eval_tokens', 0):,} tokens scored; book: PG-19 #10146 (Gutenberg "
        "header stripped)",
        "",
    ]


def write_report(record_files: list[Path], setup_file: Path | None, out: Path) -> None:
    """Merge `record_files` into `<out>.json`; write `<out>.md` and `<out>_*.png`."""
    existing = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(
        ".json").exists() else []
    new = [r for f in record_files for r in json.loads(f.read_text())]
    records = merge(existing, new)
    setup_out = out.with_name(out.name + "_setup.json")
    if setup_file is not None:
        setup_out.write_text(setup_file.read_text())
    setup = json.loads(setup_out.read_text()) if setup_out.exists() else None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    long = max((r["context"] for r in records if r["metric"] == "ppl_code"), default=0)
    short = min((r["context"] for r in records if r["metric"] == "ppl_code"), default=0)
    commits = sorted({r["commit"] for r in records})
    devices = sorted({r["device"] for r in records if r.get("device")})
    lines = ["# Real pretrained model (SmolLM2-135M-Instruct), CCA fine-tuning at long context",
             "", f"- devices: {', '.join(devices)}; commits: {', '.join(commits)}",
             "- command: `python -m benchmarks.real_model run ...` (see its docstring); "
             "each record keeps the CLI command that measured it", *setup_lines(setup),
             "## Targets", "", *targets(records, long, short), "", "## Results", "",
             *tables(records)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    from benchmarks.real_model.plots import plot_all
    plot_all(records, out)
    print("\n".join(lines))
