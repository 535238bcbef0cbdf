"""What every evaluation shares: loading the checkpoint (model + tokenizer), the run's
environment record, and writing results (JSON, markdown table)."""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

from cca_jax.cli import UsageError, attention_overrides, check_checkpoint, mesh_from_args
from cca_jax.tokenizer import load_tokenizer


def check_positive(name: str, value, *, zero_ok: bool = False) -> None:
    """UsageError unless `value` is an int > 0 (>= 0 with `zero_ok`); `name` is the flag."""
    low = 0 if zero_ok else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{name} must be an integer >= {low}, got {value!r}.")


def load_model(a):
    """`from_pretrained(--ckpt)` with the attention flags, --dtype and
    --max-position-embeddings applied, its parameters on the `--mesh` devices when given;
    UsageError for what the user can fix."""
    from cca_jax.pretrained import from_pretrained

    ckpt = check_checkpoint(a.ckpt)
    for name in ("group_size", "window_size", "max_position_embeddings"):
        if getattr(a, name, None) is not None:
            check_positive("--" + name.replace("_", "-"), getattr(a, name))
    if a.sink_tokens is not None:
        check_positive("--sink-tokens", a.sink_tokens, zero_ok=True)
    overrides = attention_overrides(a)
    if getattr(a, "max_position_embeddings", None) is not None:
        overrides["max_position_embeddings"] = a.max_position_embeddings
    if getattr(a, "rope_theta", None) is not None:
        if not a.rope_theta > 0:
            raise UsageError(f"--rope-theta must be > 0, got {a.rope_theta}.")
        overrides["rope_theta"] = a.rope_theta
    mesh = mesh_from_args(a)
    try:
        model = from_pretrained(ckpt, dtype=a.dtype, **overrides)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"cannot load the checkpoint {ckpt}: {e}") from None
    if mesh is not None:
        from cca_jax.sharding import shard_model
        shard_model(model, mesh)
    return model


def load_checkpoint_tokenizer(a):
    """The checkpoint's own tokenizer (transformers, offline), for texts of any length."""
    tokenizer = load_tokenizer(check_checkpoint(a.ckpt))
    tokenizer.model_max_length = 1 << 62     # documents outgrow it; silence the warning
    return tokenizer


# Records before format 2 stored sink_tokens 4 for cca, which then had no sinks.
ATTENTION_RECORD_FORMAT = 2


def attention_record(cfg) -> dict[str, Any]:
    """The attention settings a result was measured with."""
    att = cfg.attention
    return {"attention": att.kind, "group_size": att.group_size,
            "window_size": att.window_size, "sink_tokens": att.sink_tokens,
            "attention_format": ATTENTION_RECORD_FORMAT}


def attention_label(rec: dict[str, Any]) -> str:
    """A short name of an `attention_record` ("cca g=16 s=1024 N=4", "sliding W=1024")."""
    kind = rec.get("attention")
    if kind == "cca":
        sinks = rec.get("sink_tokens") if rec.get("attention_format", 1) >= 2 else 0
        return (f"cca g={rec['group_size']} s={rec['window_size']}"
                + (f" N={sinks}" if sinks else ""))
    if kind == "sliding":
        return f"sliding W={rec['window_size']}"
    if kind == "streaming":
        return f"streaming N={rec['sink_tokens']} W={rec['window_size']}"
    return str(kind)


def environment(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Device, versions, date and command, for every result file."""
    import jax

    argv = sys.argv[1:] if argv is None else list(argv)
    return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python -m cca_jax.eval " + " ".join(argv)}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats with 4 significant digits (thousands separated)."""
    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def environment_lines(env: dict[str, Any]) -> str:
    """The environment as markdown lines under a result table."""
    return (f"\nDevice: {env['device']} ({env['backend']}); jax {env['jax']}, python "
            f"{env['python']}; {env['date']}.\nCommand: `{env['command']}`\n")


def write_json(path: str | Path | None, record: dict[str, Any]) -> None:
    """Write `record` to `path` (directories created); nothing when path is None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
