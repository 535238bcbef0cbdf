"""Sharded CCA fine-tuning of a converted Hugging Face checkpoint (or a built-in tiny model).

    python -m train.finetune --preset tiny --steps 30 --out runs/tiny
    python -m train.finetune --checkpoint ckpt/ --data book.txt --seq-len 32768 \\
        --trainable qkv --rope-theta 500000 --steps 1000 --out runs/cca

One frozen `TrainConfig` (train/config.py) holds the run; a TOML file (`--config`) and flags
set it. The model and optimizer state are sharded over a mesh of every visible device by
`cca_jax.sharding`'s table; the step is one `jit` with NamedShardings, traced under
`jax.set_mesh` so the model pins its activations to the same table. With a `sequence` axis > 1,
cca / sliding / streaming run sequence-sharded in the zigzag layout (train/step.py);
several processes start with `--coordinator HOST:PORT --num-processes N --process-id I`
(train/multihost.py). Progress shows in a tqdm bar and goes, one JSON object per logged
step, to OUT/metrics.jsonl. Orbax saves asynchronously every `--save-every` steps into
OUT/checkpoints, keeping the last `--keep`; rerunning the same command with a larger
`--steps` resumes (parameters, optimizer state, step, data position) and metrics.jsonl
continues. The end of the run exports OUT/final (our format) and OUT/hf (Hugging Face,
`python -m convert.flax_to_hf` in a child process); `--save-every 0` (for benchmarks) saves
and exports nothing.

Every input is checked before anything is written, so a refused command leaves OUT as it was.
Ctrl-C exits with status 130 and one line: the last complete checkpoint and the command that
resumes from it.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from cca_jax.cli import UsageError, enable_compile_cache
from cca_jax.config import LlamaConfig
from cca_jax.model import LlamaForCausalLM
from cca_jax.sharding import batch_sharding, make_mesh, mesh_context, tree_shardings
from train import multihost
from train import step as steps
from train.config import (PRESET_MODELS, TRAINABLE, TrainConfig, compile_cache_args,
                          parse_args)
from train.flops import peak_flops, train_flops_per_sequence
from train.testing import pause_point

RUN_CONFIG = "run_config.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"


def preset_model_config(cfg: TrainConfig, vocab_size: int) -> LlamaConfig:
    """A preset's random LLaMA (`PRESET_MODELS`), with at least the tokenizer's vocab."""
    arch = dict(PRESET_MODELS[cfg.preset])
    arch["vocab_size"] = max(arch["vocab_size"], vocab_size)
    base = LlamaConfig(**arch, dtype=cfg.dtype, param_dtype=cfg.dtype)
    return base.replace(**cfg.model_overrides())


def _checkpoint_overrides(cfg: TrainConfig) -> dict:
    from cca_jax.checkpoint import find_config

    if not Path(cfg.checkpoint).exists():
        raise FileNotFoundError(f"--checkpoint {cfg.checkpoint}: no such directory (convert a "
                                "Hugging Face checkpoint with python -m convert.hf_to_flax).")
    stored = LlamaConfig.from_pretrained_dir(find_config(cfg.checkpoint))
    overrides = cfg.model_overrides()
    overrides["max_position_embeddings"] = max(stored.max_position_embeddings, cfg.seq_len)
    return overrides


def model_config(cfg: TrainConfig, tokenizer) -> LlamaConfig:
    """The model's config with this run's overrides, without loading any parameter."""
    from cca_jax.checkpoint import find_config

    if cfg.preset is not None:
        return preset_model_config(cfg, tokenizer.vocab_size)
    overrides = _checkpoint_overrides(cfg)
    return LlamaConfig.from_pretrained_dir(find_config(cfg.checkpoint), **overrides)


def load_model(cfg: TrainConfig, tokenizer) -> LlamaForCausalLM:
    """The model to train, with this run's attention, rope and length overrides."""
    import cca_jax

    if cfg.preset is not None:
        model_cfg = preset_model_config(cfg, tokenizer.vocab_size)
        return LlamaForCausalLM(model_cfg, rngs=nnx.Rngs(cfg.seed))
    return cca_jax.from_pretrained(cfg.checkpoint, dtype=cfg.dtype,
                                   **_checkpoint_overrides(cfg))


DATA_CACHE = "data_cache"


def check_run_dir(cfg: TrainConfig) -> Path:
    """OUT must be new, empty (but for our data cache), or a run of the same settings."""
    out = Path(cfg.out)
    saved = out / RUN_CONFIG
    if saved.exists():
        try:
            previous = TrainConfig(**json.loads(saved.read_text()))
        except (TypeError, ValueError) as e:    # another version's settings, or edited
            raise ValueError(f"{saved} is not a run config this version reads ({e}); use "
                             "another --out.") from None
        differ = cfg.same_run(previous)
        if differ:
            raise ValueError(f"{out} holds a different run (settings {differ} differ); use "
                             "another --out, or the same settings to resume it.")
    elif out.exists() and {p.name for p in out.iterdir()} - {DATA_CACHE}:
        raise ValueError(f"{out} exists and is not a cca-jax run directory; choose a new or "
                         "empty --out (nothing in it is overwritten).")
    return out


def record_run(out: Path, cfg: TrainConfig) -> None:
    """Write OUT/run_config.json once every input has been checked."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=1))


def check_shapes(cfg: TrainConfig, mesh, model_cfg: LlamaConfig, tokenizer) -> None:
    """Clear errors before any compute for what the model or mesh cannot take."""
    data = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.micro_batch % data:
        raise ValueError(f"each micro-batch holds {cfg.micro_batch} sequences (--batch-size / "
                         f"--grad-accum), which the mesh's data x fsdp = {data} devices do not "
                         "divide; raise --batch-size or change --mesh.")
    steps.check_sequence_split(mesh, model_cfg.attention.pattern, cfg.seq_len)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                         f"{model_cfg.vocab_size}: is the tokenizer the checkpoint's own?")


def _metrics_continue(path: Path, step: int) -> None:
    """Keep only metrics.jsonl lines of steps <= `step`, the step the run (re)starts from: a
    run killed before its checkpoint logged steps that the rerun logs again."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _device_batch(batch: dict, cfg: TrainConfig, sharding, sequence_sharding) -> dict:
    """`[grad_accum, micro_batch, seq_len]` global arrays, rows in the model's layout."""
    shaped = {k: np.asarray(batch[k]).reshape(cfg.grad_accum, cfg.micro_batch, cfg.seq_len)
              for k in steps.BATCH_KEYS}
    return multihost.global_batch(steps.in_row_order(shaped, sequence_sharding), sharding)


EXPORT_STEP = "trained_steps.json"   # in OUT/final: the step its parameters are from
EXPORTING = ".export"                # OUT/.export: exports while they are written


class ExportError(Exception):
    """The Hugging Face export failed (the training and OUT/final are complete)."""


def _export_tag(final: Path) -> str | None:
    """How an existing OUT/final is set aside: "step<K>" (its marker), "unmarked" (no marker:
    cut short by a kill under an older version, or older than the marker), None if absent."""
    if not final.exists():
        return None
    marker = final / EXPORT_STEP
    return f"step{json.loads(marker.read_text())['step']}" if marker.exists() else "unmarked"


def _set_aside(path: Path, tag: str) -> None:
    """Rename `path` to `<name>-<tag>` (a free name): kept, never overwritten or deleted."""
    target, n = path.with_name(f"{path.name}-{tag}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}-{tag}-{n}")
    path.rename(target)


def _export_hf(final: Path, building: Path, hf: Path) -> None:
    """OUT/hf from OUT/final by `python -m convert.flax_to_hf` in a child process, built in
    `building` and renamed into place. In a child, the converter's orbax restores are no
    collective of this job: in a run of several processes only process 0 exports, and a
    restore in it waited for processes that were waiting for the end of the run."""
    root = str(Path(__file__).resolve().parents[1])     # where convert/ lives
    env = {**os.environ, "JAX_PLATFORMS": "cpu",       # host arrays only; devices stay ours
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "convert.flax_to_hf", "--ckpt", str(final),
                           "--out", str(building), "--quiet"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise ExportError(f"the Hugging Face export failed ({last}); OUT/final is complete: "
                          f"python -m convert.flax_to_hf --ckpt {final} --out {hf} retries it.")
    building.rename(hf)


def _export(out: Path, state, model_cfg: LlamaConfig, cfg: TrainConfig, step: int) -> None:
    """OUT/final (our format, saved by every process together, as orbax does) and OUT/hf
    (process 0), of the parameters after `step` steps. Each is built under OUT/.export and
    renamed into place when complete, so a kill never leaves a partial export under a final
    name (a rerun removes OUT/.export and exports again). A longer rerun of the run exports
    again: the earlier export moves to OUT/final-step<K> (and hf-step<K>)."""
    from cca_jax.checkpoint import save_pretrained
    from convert.hf_io import copy_tokenizer_files

    final, hf, building = out / "final", out / "hf", out / EXPORTING
    params = multihost.to_host(steps.merge_params(state.trainable, state.frozen))
    multihost.barrier("export")
    earlier = _export_tag(final)
    multihost.barrier("export decided")     # every process takes the same branch
    main = multihost.is_main()
    if main and building.exists():
        shutil.rmtree(building)             # what a kill cut short: ours, and never used
    if earlier != f"step{step}":
        if main and earlier is not None:
            _set_aside(final, earlier)
            if hf.exists():
                _set_aside(hf, earlier)
        multihost.barrier("export moved")
        save_pretrained(building / "final", params, model_cfg)
        if main:
            (building / "final" / EXPORT_STEP).write_text(json.dumps({"step": step}))
            if cfg.checkpoint is not None:
                copy_tokenizer_files(Path(cfg.checkpoint), building / "final")
            pause_point("export")
            (building / "final").rename(final)
    if main and cfg.export_hf and not hf.exists():
        _export_hf(final, building / "hf", hf)
    if main and building.exists():
        building.rmdir()


def run(cfg: TrainConfig) -> dict:
    """Train; returns {"losses": [...] of this invocation's steps, "out": OUT}."""
    from train.data import check_source, make_batches, make_tokenizer

    multihost.initialize(cfg)
    # Every check before the first write: a refused run leaves OUT as it was, so the
    # corrected command can use the same --out.
    out = check_run_dir(cfg)
    tokenizer = make_tokenizer(cfg.checkpoint)
    mesh = make_mesh(cfg.mesh_shape)
    check_shapes(cfg, mesh, model_config(cfg, tokenizer), tokenizer)
    data_cache = str(out / DATA_CACHE)
    check_source(cfg.data, data_dir=cfg.data_dir, text_field=cfg.text_field,
                 cache_dir=data_cache)
    model = load_model(cfg, tokenizer)    # its own checks: a Hugging Face dir, no params...
    multihost.barrier("inputs checked")   # no process writes into OUT before all have read it

    def data():
        batches = make_batches(cfg.data, tokenizer, seq_len=cfg.seq_len,
                               batch_size=cfg.batch_size, seed=cfg.seed, data_dir=cfg.data_dir,
                               text_field=cfg.text_field, cache_dir=data_cache)
        if multihost.is_main():
            record_run(out, cfg)
        return batches
    batches = multihost.main_first("data prepared", data)   # one preparation of a data cache

    model_cfg = model.config
    sequence_sharding = steps.sequence_sharding_for(mesh, model_cfg.attention.pattern)
    model.sequence_sharding = sequence_sharding
    graphdef, model_state = nnx.split(model)
    apply = steps.model_apply(graphdef, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model_state))
    tx = steps.make_optimizer(cfg)
    init = functools.partial(steps.init_state, cfg=cfg, tx=tx)
    shardings = tree_shardings(jax.eval_shape(init, steps.params_of(model)), mesh)
    params = steps.params_of(model)
    if jax.process_count() > 1:   # each process's copy (identical) enters as host data
        params = jax.device_get(params)
    state = jax.jit(init, out_shardings=shardings)(params)
    del params
    del model
    batch_spec = batch_sharding(mesh).spec
    batch_sharding3 = NamedSharding(mesh, PartitionSpec(None, *batch_spec))
    train_step = jax.jit(steps.make_train_step(apply, cfg, tx),
                         in_shardings=(shardings, batch_sharding3),
                         out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
                         donate_argnums=(0,))

    manager = ocp.CheckpointManager(
        (out / CHECKPOINTS).absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, create=True,
                                             enable_async_checkpointing=True))
    start = manager.latest_step() or 0
    if start:
        abstract_state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
        restored = manager.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state._asdict()),
            data=ocp.args.JsonRestore()))
        state = steps.TrainState(**restored["state"])
        batches.set_state(restored["data"])
    if multihost.is_main():
        _metrics_continue(out / METRICS, start)

    flops = train_flops_per_sequence(model_cfg, cfg.seq_len, TRAINABLE[cfg.trainable])
    flops *= cfg.batch_size
    peak = peak_flops(jax.devices()[0].device_kind)
    losses = []
    schedule = steps.lr_schedule(cfg)
    last = time.perf_counter()
    metrics_path = out / METRICS if multihost.is_main() else Path(os.devnull)
    try:
        with (open(metrics_path, "a") as log,
              tqdm(total=cfg.steps, initial=start, desc="train", unit="step",
                   disable=not multihost.is_main()) as bar):
            for step in range(start, cfg.steps):
                batch = _device_batch(next(batches), cfg, batch_sharding3, sequence_sharding)
                if step == start:
                    with mesh_context(mesh):   # the model's activation constraints
                        train_step = train_step.lower(state, batch).compile()
                    # Processes compile at different speeds (one may hit a compilation
                    # cache); they start the step together: CPU (gloo) collectives give up
                    # when a peer is 30 s late.
                    multihost.barrier("step compiled")
                state, metrics = train_step(state, batch)
                if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    now = time.perf_counter()
                    seconds = (now - last) / ((step - start) % cfg.log_every + 1
                                              if step > start else 1)
                    last = now
                    record = {"step": step + 1, "loss": metrics["loss"],
                              "grad_norm": metrics["grad_norm"],
                              "lr": float(schedule(step)),
                              "step_s": seconds,
                              "tokens_per_s": cfg.batch_size * cfg.seq_len / seconds,
                              "mfu": (flops / seconds / (peak * jax.device_count())
                                      if peak else None)}
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    losses.append(record["loss"])
                    bar.set_postfix(loss=f"{record['loss']:.4f}",
                                    tok_s=f"{record['tokens_per_s']:.0f}")
                bar.update(1)
                if cfg.save_every and ((step + 1) % cfg.save_every == 0
                                       or step + 1 == cfg.steps):
                    pause_point(f"save {step + 1}")
                    manager.save(step + 1, args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state._asdict()),
                        data=ocp.args.JsonSave(batches.get_state())))
                pause_point(f"step {step + 1}")
    finally:
        manager.wait_until_finished()   # also on Ctrl-C: the save in flight completes
        manager.close()
    if cfg.save_every:
        _export(out, state, model_cfg, cfg, cfg.steps)
    multihost.barrier("run done")   # no process leaves while another still exports
    return {"losses": losses, "out": str(out)}


def last_checkpoint(out: Path) -> int | None:
    """The step of the last complete checkpoint in OUT/checkpoints (None: there is none)."""
    found = ocp.utils.checkpoint_steps(out / CHECKPOINTS)
    return max(found) if found else None


def interrupted(cfg: TrainConfig | None, argv: list[str]) -> str:
    """The one line Ctrl-C prints: the last complete checkpoint and the command resuming it."""
    command = shlex.join(["python", "-m", "train.finetune", *argv])
    if cfg is None:
        return f"interrupted; rerun with: {command}"
    step = last_checkpoint(Path(cfg.out))
    if step is None:
        return (f"interrupted before the first checkpoint of {cfg.out}; the same command "
                f"starts again: {command}")
    return (f"interrupted: the last complete checkpoint is step {step} of {cfg.out}; resume "
            f"from it with: {command}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = None
    try:
        cfg = parse_args(argv)
        enable_compile_cache(compile_cache_args(argv))
        result = run(cfg)
    except (ValueError, FileNotFoundError, UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(interrupted(cfg, argv), file=sys.stderr)
        return 130
    print(f"done: {len(result['losses'])} steps logged to {Path(result['out']) / METRICS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
