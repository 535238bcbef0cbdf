"""Every budget and choice of the real-model experiment, in frozen objects (one per preset).

The `h200` preset is the experiment; `cpu` runs the same chain at toy sizes, to check the
harness on a 2-core machine. Variants differ only in their attention option and in what
trains: the data, its order, the steps, tokens, schedule and evaluations are shared.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One run of the experiment: model extension, fine-tuning budget and evaluations."""

    # context extension (every variant but `original`): 8K -> seq_len, RoPE theta raised
    seq_len: int = 32768
    rope_theta: float = 1e6
    # fine-tuning budget, identical for every fine-tuned variant
    batch_size: int = 4
    steps: int = 160                  # 160 x 4 x 32768 = 20.97M tokens
    lr: float = 1e-4
    warmup_steps: int = 16
    dtype: str = "bfloat16"           # activations; parameters stay float32 (`param_dtype`)
    param_dtype: str = "float32"
    save_every: int = 40
    seed: int = 0
    # attention settings shared by the options (the paper's g and s; the same raw window)
    group_size: int = 16
    window_size: int = 1024
    sink_tokens: int = 4
    # evaluations
    native_context: int = 8192        # the original model's own context
    short_context: int = 2048         # short-text perplexity (extension must not cost it)
    eval_contexts: tuple[int, ...] = (8192, 16384, 32768)
    eval_code_chars: int = 4_000_000  # held-out code text kept for perplexity (~1M tokens)
    eval_book_chars: int | None = None  # None: the whole book
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_samples: int = 4
    passkey_batch: int = 4
    kv_limit: int = 100               # key-value retrieval records scored
    kv_batch: int = 8
    efficiency_context: int = 32768   # TTFT and decode ms/token
    # corpus (built from the installed Python packages of the machine that runs it)
    heldout_packages: tuple[str, ...] = ("networkx",)
    doc_chars: int = 400_000          # a package's files are cut into documents of ~this size
    max_file_bytes: int = 1_000_000   # larger files are generated data, not code: skipped
    corpus_max_chars: int | None = None   # None: every package; else a deterministic subset
    corpus_min_tokens: int = 50_000_000

    @property
    def train_tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    def option_flags(self, option: str) -> list[str]:
        """The CLI flags of an attention option (the same for train.finetune and eval)."""
        g, s, n = str(self.group_size), str(self.window_size), str(self.sink_tokens)
        flags = {
            "full": ["--attention", "full"],
            "cca": ["--attention", "cca", "--group-size", g, "--window-size", s],
            "cca_sinks": ["--attention", "cca", "--group-size", g, "--window-size", s,
                          "--sink-tokens", n],
            "sliding": ["--attention", "sliding", "--window-size", s],
            "streaming": ["--attention", "streaming", "--window-size", s, "--sink-tokens", n],
        }
        return flags[option]


PRESETS = {
    "h200": Experiment(),
    # The same chain at toy sizes (a 2-core CPU, minutes): checks the harness, not the model.
    "cpu": Experiment(seq_len=512, batch_size=2, steps=3, warmup_steps=1, save_every=2,
                      group_size=16, window_size=128, native_context=512, short_context=128,
                      eval_contexts=(256, 512), eval_code_chars=20_000, eval_book_chars=20_000,
                      passkey_depths=(0.0, 1.0), passkey_samples=1, passkey_batch=2,
                      kv_limit=1, kv_batch=1, efficiency_context=512,
                      doc_chars=100_000, corpus_max_chars=3_000_000, corpus_min_tokens=0),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    """A model measured: an attention option, swapped in as is or fine-tuned.

    option: a key of `Experiment.option_flags` (None: the checkpoint's own, full attention).
    trainable: None (no fine-tuning) or train.finetune's --trainable.
    native: the original model as published (its own RoPE theta, at its own context).
    lr: a learning rate other than the experiment's (the sweep that asks whether the budget's
    rate, not CCA, limits a fine-tune); None: `Experiment.lr`.
    """

    name: str
    option: str | None
    trainable: str | None = None
    native: bool = False
    lr: float | None = None

    @property
    def fine_tuned(self) -> bool:
        return self.trainable is not None


VARIANTS = {v.name: v for v in (
    Variant("original", None, native=True),
    Variant("full_swap", "full"),
    Variant("cca_swap", "cca"),
    Variant("cca_sinks_swap", "cca_sinks"),
    Variant("sliding_swap", "sliding"),
    Variant("streaming_swap", "streaming"),
    Variant("full_ft", "full", "all"),
    Variant("cca_ft", "cca", "all"),
    Variant("cca_qkv_ft", "cca", "qkv"),
    Variant("cca_sinks_ft", "cca_sinks", "all"),
    Variant("sliding_ft", "sliding", "all"),
    Variant("streaming_ft", "streaming", "all"),
    Variant("cca_ft_lr3e-5", "cca", "all", lr=3e-5),
    Variant("cca_ft_lr3e-4", "cca", "all", lr=3e-4),
)}
