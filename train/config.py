"""The fine-tuning run's configuration: one frozen dataclass, from a TOML file plus CLI flags.

Every field is a flag (`--seq-len 131072`, `--mesh fsdp=4,sequence=2`); a TOML file given
with `--config` sets defaults that flags override. Defaults follow the CCA paper's recipe:
AdamW, lr 2e-5, no weight decay, 20 warmup steps then constant, max grad norm 2.0, bf16
parameters with float32 optimizer state, 1000 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from typing import Any

from cca_jax.sharding import MESH_AXES

TRAINABLE = {
    # which parameters train; the rest are frozen and get no optimizer state
    "all": None,
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "qkv": ("q_proj", "k_proj", "v_proj"),
}
# Defaults a preset brings (below the TOML file and the flags): sized for a 2-core CPU.
PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": dict(seq_len=128, batch_size=8, lr=3e-3, warmup_steps=10, dtype="float32",
                 remat="none", save_every=50, attention="cca", group_size=4, window_size=16,
                 implementation="xla", loss_chunk=64),
    # Random weights of LLaMA-2-7B's shape, for measuring steps without a checkpoint.
    "llama2-7b-shape": dict(attention="cca", group_size=16, window_size=1024),
    # Random weights of TinyLlama-1.1B's shape (GQA, 4 KV heads): all-parameter runs.
    "tinyllama-1.1b-shape": dict(attention="cca", group_size=16, window_size=1024),
}
# Architecture of each preset's random model (vocab: the tokenizer's, at least).
PRESET_MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=0, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "llama2-7b-shape": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                            num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=32),
    "tinyllama-1.1b-shape": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                 num_hidden_layers=22, num_attention_heads=32,
                                 num_key_value_heads=4),
}
PRESETS = tuple(PRESET_DEFAULTS)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One fine-tuning run. `checkpoint` (from convert/) or `preset` says what model."""

    out: str = ""
    checkpoint: str | None = None
    preset: str | None = None          # a random model: "tiny" (CPU) or "llama2-7b-shape"
    # data
    data: str = "builtin"              # "builtin", a .txt/.jsonl(.gz)/dir path, "tfds:NAME[:SPLIT]"
    data_dir: str | None = None        # TFDS data dir
    text_field: str = "text"
    seq_len: int = 4096
    # Packed documents see only themselves (segment ids; RoPE positions restart per document).
    # --no-document-mask: each row is one stretch of text that attends across its documents
    # with positions 0..L-1 (the paper's LongLoRA-style data), which cuDNN's full attention
    # can run (it takes no segment ids).
    document_mask: bool = True
    batch_size: int = 1                # sequences per optimizer step, across all devices...
    grad_accum: int = 1                # ...in this many micro-batches
    # model and attention (None: the checkpoint's own)
    attention: str | None = None
    group_size: int | None = None
    window_size: int | None = None
    sink_tokens: int | None = None
    implementation: str | None = None
    rope_theta: float | None = None    # the paper used 5e5 for LLaMA-2 at long context
    remat: str = "full"
    dtype: str = "bfloat16"
    # optimizer
    trainable: str = "all"
    lr: float = 2e-5
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 2.0
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    # run
    steps: int = 1000                  # total length of the run (a rerun with more resumes)
    seed: int = 0
    mesh: str = "fsdp=-1"              # axis=size pairs over data, fsdp, tensor, sequence
    save_every: int = 100              # 0: never (benchmarks)
    keep: int = 2
    log_every: int = 1
    loss_chunk: int = 1024             # tokens per chunk of the cross-entropy
    export_hf: bool = True
    # several processes (train/multihost.py): jax.distributed.initialize's arguments
    distributed: bool = False          # also implied by --coordinator
    coordinator: str | None = None     # HOST:PORT of process 0's coordinator service
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)
        need(bool(self.out), "--out is required: the run's output directory.")
        need((self.checkpoint is None) != (self.preset is None),
             "give exactly one of --checkpoint DIR (from convert.hf_to_flax) or --preset tiny.")
        need(self.preset in (None, *PRESETS), f"--preset must be one of {PRESETS}.")
        need(self.trainable in TRAINABLE, f"--trainable must be one of {tuple(TRAINABLE)}.")
        need(isinstance(self.save_every, int) and self.save_every >= 0,
             "--save-every must be >= 0 (0: no checkpoints, for benchmarks).")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "keep",
                     "log_every", "loss_chunk"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                 f"--{name.replace('_', '-')} must be a positive integer.")
        need(self.seq_len >= 2, "--seq-len must be at least 2.")
        need(self.batch_size % self.grad_accum == 0,
             f"--batch-size {self.batch_size} must be a multiple of --grad-accum "
             f"{self.grad_accum} (each micro-batch holds batch_size / grad_accum sequences).")
        need(self.lr > 0 and self.max_grad_norm > 0, "--lr and --max-grad-norm must be > 0.")
        if self.coordinator is not None:
            need(self.num_processes is not None and self.num_processes >= 1
                 and self.process_id is not None
                 and 0 <= self.process_id < self.num_processes,
                 "--coordinator HOST:PORT needs --num-processes N and --process-id I "
                 "(0 <= I < N, a different I on each process).")
        self.mesh_shape  # validates  # noqa: B018

    @property
    def is_distributed(self) -> bool:
        """Whether this process is one of several (jax.distributed.initialize)."""
        return self.distributed or self.coordinator is not None

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def mesh_shape(self) -> dict[str, int]:
        shape = {}
        for part in filter(None, self.mesh.split(",")):
            name, _, size = part.partition("=")
            if name not in MESH_AXES or not size.lstrip("-").isdigit():
                raise ValueError(f"--mesh {self.mesh!r}: expected axis=size pairs over "
                                 f"{MESH_AXES}, e.g. 'fsdp=4,sequence=2' (one size may be -1).")
            shape[name] = int(size)
        return shape

    def model_overrides(self) -> dict[str, Any]:
        """LlamaConfig overrides this run asks for (flat, as `from_pretrained` takes them)."""
        names = ("attention", "group_size", "window_size", "sink_tokens", "implementation",
                 "rope_theta")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        out.update(remat=self.remat, max_position_embeddings=self.seq_len)
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def same_run(self, other: "TrainConfig") -> list[str]:
        """Fields that differ from `other`, ignoring those a resumed run may change."""
        free = {"steps", "save_every", "keep", "log_every", "export_hf", "distributed",
                "coordinator", "num_processes", "process_id"}
        return sorted(f.name for f in dataclasses.fields(self)
                      if f.name not in free and getattr(self, f.name) != getattr(other, f.name))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_args(argv=None) -> TrainConfig:
    """TrainConfig from `--config FILE.toml` (optional) and flags (which win)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--preset")
    known, _ = pre.parse_known_args(argv)
    from_file: dict[str, Any] = {}
    if known.config:
        with open(known.config, "rb") as f:
            from_file = tomllib.load(f)
        unknown = sorted(set(from_file) - {f.name for f in dataclasses.fields(TrainConfig)})
        if unknown:
            raise ValueError(f"{known.config}: unknown settings {unknown}.")
    preset = known.preset or from_file.get("preset")
    defaults = {**PRESET_DEFAULTS.get(preset, {}), **from_file}
    ap = argparse.ArgumentParser(prog="python -m train.finetune",
                                 description="Sharded CCA fine-tuning (see README).")
    ap.add_argument("--config", help="a TOML file of settings; flags override it")
    for f in dataclasses.fields(TrainConfig):
        default = defaults.get(f.name, f.default)
        if f.type in ("bool",):
            ap.add_argument(_flag(f.name), default=default,
                            action=argparse.BooleanOptionalAction)
            continue
        kind = {"int": int, "float": float}.get(str(f.type), None)
        if str(f.type).startswith("int |"):
            kind = int
        elif str(f.type).startswith("float |"):
            kind = float
        ap.add_argument(_flag(f.name), default=default, type=kind or str)
    values = vars(ap.parse_args(argv))
    values.pop("config")
    return TrainConfig(**values)
