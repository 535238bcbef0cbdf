"""The fine-tuning run's configuration: one frozen dataclass, from a TOML file plus CLI flags.

Every field is a flag (`--seq-len 131072`, `--mesh fsdp=4,sequence=2`); a TOML file given
with `--config` sets defaults that flags override. Defaults follow the CCA paper's recipe:
AdamW, lr 2e-5, no weight decay, 20 warmup steps then constant, max grad norm 2.0, bf16
parameters with float32 optimizer state, 1000 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tomllib
import types
from pathlib import Path
from typing import Any, Mapping

from cca_jax.attention import IMPLEMENTATION_CHOICES
from cca_jax.blocks import ATTENTION_KINDS
from cca_jax.cli import add_compile_cache_args
from cca_jax.config import DTYPES, REMAT_POLICIES
from cca_jax.sharding import parse_mesh

TRAINABLE: Mapping[str, tuple[str, ...] | None] = types.MappingProxyType({
    # which parameters train; the rest are frozen and get no optimizer state
    "all": None,
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "qkv": ("q_proj", "k_proj", "v_proj"),
})
# Defaults a preset brings (below the TOML file and the flags): sized for a 2-core CPU.
PRESET_DEFAULTS: Mapping[str, Mapping[str, Any]] = types.MappingProxyType({
    "tiny": dict(seq_len=128, batch_size=8, lr=3e-3, warmup_steps=10, dtype="float32",
                 remat="none", save_every=50, attention="cca", group_size=4, window_size=16,
                 implementation="xla", loss_chunk=64),
    # Random weights of LLaMA-2-7B's shape, for measuring steps without a checkpoint.
    "llama2-7b-shape": dict(attention="cca", group_size=16, window_size=1024),
    # Random weights of TinyLlama-1.1B's shape (GQA, 4 KV heads): all-parameter runs.
    "tinyllama-1.1b-shape": dict(attention="cca", group_size=16, window_size=1024),
})
# Architecture of each preset's random model (vocab: the tokenizer's, at least).
PRESET_MODELS: Mapping[str, Mapping[str, Any]] = types.MappingProxyType({
    "tiny": dict(vocab_size=0, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "llama2-7b-shape": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                            num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=32),
    "tinyllama-1.1b-shape": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                 num_hidden_layers=22, num_attention_heads=32,
                                 num_key_value_heads=4),
})
PRESETS = tuple(PRESET_DEFAULTS)


def _opt(default: Any, help: str, choices: tuple | None = None, unset: str = "") -> Any:
    """A `TrainConfig` field with its flag's help text, choices and (for a None default) what
    leaving it unset means: `--help` is generated from these (`build_parser`), so each
    setting is described in this one place."""
    return dataclasses.field(default=default,
                             metadata={"help": help, "choices": choices, "unset": unset})


OWN = "the checkpoint's own"    # what an unset model setting means


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One fine-tuning run. `checkpoint` (from convert/) or `preset` says what model."""

    out: str = _opt("", "the run's output directory (required): checkpoints/, metrics.jsonl, "
                    "final/ and hf/; a rerun into the same one resumes")
    checkpoint: str | None = _opt(None, "the model to fine-tune: a directory written by "
                                  "python -m convert.hf_to_flax (or give --preset)")
    preset: str | None = _opt(None, "a random model instead of --checkpoint: tiny runs on a "
                              "CPU, the *-shape ones time real model sizes", PRESETS)
    # data
    data: str = _opt("builtin", "the text to train on: builtin, a .txt / .jsonl / .jsonl.gz "
                     "file or a directory of them, or tfds:NAME[:SPLIT]")
    data_dir: str | None = _opt(None, "where a tfds: data set is prepared",
                                unset="~/tensorflow_datasets")
    text_field: str = _opt("text", "the field holding the text in .jsonl records and TFDS "
                           "features")
    seq_len: int = _opt(4096, "tokens per training row")
    document_mask: bool = _opt(True, "packed documents see only themselves (segment ids), "
                               "positions restarting per document; --no-document-mask: a row "
                               "attends across its documents at positions 0..L-1 (the "
                               "paper's LongLoRA-style data; cuDNN's full attention runs it)")
    batch_size: int = _opt(1, "sequences per optimizer step, across all devices")
    grad_accum: int = _opt(1, "micro-batches the --batch-size is split into (gradient "
                           "accumulation)")
    # model and attention (None: the checkpoint's own)
    attention: str | None = _opt(None, "the attention option to train with",
                                 tuple(sorted(ATTENTION_KINDS)), OWN)
    group_size: int | None = _opt(None, "cca: tokens pooled into one core token",
                                  unset=OWN)
    window_size: int | None = _opt(None, "cca / sliding / streaming: the local window in "
                                   "tokens", unset=OWN)
    sink_tokens: int | None = _opt(None, "streaming, cca: the first tokens every query "
                                   "sees raw (attention sinks)",
                                   unset=OWN)
    implementation: str | None = _opt(None, "the attention backend",
                                      IMPLEMENTATION_CHOICES, OWN)
    rope_theta: float | None = _opt(None, "RoPE base (the paper used 5e5 for LLaMA-2 "
                                    "at long context)", unset=OWN)
    remat: str = _opt("full", "per-layer rematerialization policy", tuple(REMAT_POLICIES))
    dtype: str = _opt("bfloat16", "parameter and activation dtype (optimizer state stays "
                      "float32)", tuple(DTYPES))
    param_dtype: str | None = _opt(None, "parameter dtype, if not --dtype: float32 keeps a "
                                   "float32 master copy whose small updates bfloat16 "
                                   "parameters would round away, while activations run in "
                                   "--dtype", tuple(DTYPES))
    # optimizer
    trainable: str = _opt("all", "which parameters train; the rest are frozen and get no "
                          "optimizer state", tuple(TRAINABLE))
    lr: float = _opt(2e-5, "AdamW learning rate after the warm-up")
    warmup_steps: int = _opt(20, "steps of linear warm-up from 0 to --lr, then constant")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    max_grad_norm: float = _opt(2.0, "gradients are clipped to this global norm")
    adam_b1: float = _opt(0.9, "AdamW beta1")
    adam_b2: float = _opt(0.95, "AdamW beta2")
    # run
    steps: int = _opt(1000, "total optimizer steps of the run (a rerun with more resumes)")
    seed: int = _opt(0, "seed of the random model and of the data order")
    mesh: str = _opt("fsdp=-1", "device mesh as axis=size pairs over data, fsdp, tensor, "
                     "sequence, e.g. fsdp=4,sequence=2 (one size may be -1: the rest)")
    save_every: int = _opt(100, "steps between checkpoints; 0: no checkpoints and no export "
                           "(benchmarks)")
    keep: int = _opt(2, "checkpoints kept (the oldest are deleted)")
    log_every: int = _opt(1, "steps between metrics.jsonl records")
    loss_chunk: int = _opt(1024, "tokens per chunk of the cross-entropy (the [L, vocab] "
                           "logits never exist at once)")
    export_hf: bool = _opt(True, "also export OUT/hf (Hugging Face format) at the end")
    # several processes (train/multihost.py): jax.distributed.initialize's arguments
    distributed: bool = _opt(False, "one of several processes, found by JAX itself (Cloud "
                             "TPU, SLURM, Open MPI, Kubernetes); implied by --coordinator")
    coordinator: str | None = _opt(None, "HOST:PORT of process 0's coordinator service, for "
                                   "several processes")
    num_processes: int | None = _opt(None, "how many processes run the job (with "
                                     "--coordinator)")
    process_id: int | None = _opt(None, "this process's index, 0..N-1 (with --coordinator)")

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
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}.")
        need(self.max_grad_norm > 0, f"--max-grad-norm must be > 0, got {self.max_grad_norm}.")
        need(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}.")
        need(0 <= self.adam_b1 < 1 and 0 <= self.adam_b2 < 1,
             f"--adam-b1 and --adam-b2 must be in [0, 1), got {self.adam_b1}, {self.adam_b2}.")
        need(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0,
             "--warmup-steps must be an integer >= 0.")
        need(isinstance(self.seed, int) and 0 <= self.seed < 2**32,
             f"--seed must be an integer in [0, 2**32), got {self.seed}.")
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
        return parse_mesh(self.mesh)

    def model_overrides(self) -> dict[str, Any]:
        """LlamaConfig overrides this run asks for (flat, as `from_pretrained` takes them)."""
        names = ("attention", "group_size", "window_size", "sink_tokens", "implementation",
                 "rope_theta")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        out.update(remat=self.remat, max_position_embeddings=self.seq_len)
        if self.param_dtype is not None:
            out["param_dtype"] = self.param_dtype
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


def _kind(field: dataclasses.Field) -> str:
    """The field's value type: "int", "float", "str" or "bool" (its annotation, less None)."""
    return str(field.type).split("|")[0].strip()


def _is_negative_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return token.startswith("-")


def attach_negative_values(argv: list[str]) -> list[str]:
    """`--lr -1e-3` as `--lr=-1e-3`: argparse takes a token like -1e-3 for an option and says
    "expected one argument"; a number is a value, whatever its sign."""
    out: list[str] = []
    for token in argv:
        if (out and out[-1].startswith("--") and "=" not in out[-1]
                and _is_negative_number(token)):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def read_toml(path: str) -> dict[str, Any]:
    """The settings of a `--config` file, checked against `TrainConfig`'s fields and types;
    every problem is a one-line ValueError naming the file (and the line, for syntax)."""
    try:
        settings = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file.") from None
    except (IsADirectoryError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path}: not a TOML text file ({e}).") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: invalid TOML: {e}; fix that line.") from None
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown settings {unknown}; the keys are the flag names "
                         "with underscores (python -m train.finetune --help).")
    types = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
    for name, value in settings.items():
        kind = _kind(fields[name])
        if isinstance(value, bool) != (kind == "bool") or not isinstance(value, types[kind]):
            raise ValueError(f"{path}: {name} = {value!r} is not a{'n' * (kind == 'int')} "
                             f"{kind}.")
    return settings


def build_parser(defaults: dict[str, Any]) -> argparse.ArgumentParser:
    """One flag per `TrainConfig` field, with the help, default and choices of its `_opt`."""
    ap = argparse.ArgumentParser(prog="python -m train.finetune",
                                 description="Sharded CCA fine-tuning (README: Fine-tuning). "
                                 "Settings come from the flags, then a --config TOML file, "
                                 "then the preset, then these defaults.")
    ap.add_argument("--config", metavar="FILE.toml",
                    help="a TOML file of settings (keys: the flag names with underscores); "
                    "flags override it")
    add_compile_cache_args(ap)   # where compiled programs are kept: not a run setting
    for f in dataclasses.fields(TrainConfig):
        default = defaults.get(f.name, f.default)
        shown = f.metadata["unset"] if default in (None, "") else "%(default)s"
        help_text = f.metadata["help"] + (f" (default: {shown})" if shown else "")
        kind = _kind(f)
        if kind == "bool":
            ap.add_argument(_flag(f.name), default=default, help=help_text,
                            action=argparse.BooleanOptionalAction)
            continue
        ap.add_argument(_flag(f.name), default=default, help=help_text,
                        choices=f.metadata["choices"],
                        type={"int": int, "float": float}.get(kind, str))
    return ap


def parse_args(argv=None) -> TrainConfig:
    """TrainConfig from `--config FILE.toml` (optional) and flags (which win)."""
    argv = attach_negative_values(list(sys.argv[1:] if argv is None else argv))
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--preset")
    known, _ = pre.parse_known_args(argv)
    from_file = read_toml(known.config) if known.config else {}
    preset = known.preset or from_file.get("preset")
    defaults = {**PRESET_DEFAULTS.get(preset, {}), **from_file}
    values = vars(build_parser(defaults).parse_args(argv))
    for name in ("config", "compile_cache", "no_compile_cache"):
        values.pop(name)
    return TrainConfig(**values)


def compile_cache_args(argv) -> argparse.Namespace:
    """The `--compile-cache` / `--no-compile-cache` flags of a command line (for
    `cli.enable_compile_cache`; `parse_args` leaves them out of the TrainConfig)."""
    ap = argparse.ArgumentParser(add_help=False)
    add_compile_cache_args(ap)
    return ap.parse_known_args(list(argv))[0]
