"""The serving engine's fixed shapes and limits (`EngineConfig`, what every program is
compiled for), and the policy they set for the chunk that runs while rows decode
(`pick_interleaved_chunk`). The CLI's flags map onto `EngineConfig` (`serve.__main__`)."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's fixed shapes and limits (every program is compiled for these)."""
    max_batch: int = 8        # B: rows of the cache, requests generating at once
    max_len: int = 4096       # positions per row: prompt + max_tokens must fit
    chunk_size: int = 512     # prompt tokens per prefill chunk while no row is decoding
    prefill_rows: int = 1     # P: requests one prefill chunk carries (<= max_batch)
    max_queue: int = 64       # requests waiting for a row; beyond it submit() refuses
    # prompt tokens per prefill chunk while some row is decoding (bounds the inter-token
    # time: one decode step plus one such chunk); None: chunk_size
    decode_chunk_size: int | None = None
    # with rows decoding, run the largest chunk (of `interleaved_chunk_sizes`: powers of two
    # from decode_chunk_size to chunk_size, all compiled) whose measured time plus the
    # decode step's keeps a turn within this many milliseconds; the smallest if none does.
    # None: always decode_chunk_size
    itl_target_ms: float | None = None
    # on a GPU, prefill chunks of at most this many tokens (prefill_rows x chunk) run their
    # layers unrolled (`prefill_chunk(unroll_layers=True)`: weights read in place, faster
    # turns for a compile about twice as long: cca_jax/serve/NOTES.md); 0: never
    unroll_chunk_tokens: int = 2048
    # compile the prefill and decode programs at start-up in threads at once (XLA compiles
    # outside the GIL), so that a cold start may wait for the longest compile, not their
    # sum. Off by default: on a 2-core CPU it started slower (16 layers: 18.29 s against
    # 17.88, benchmarks/results/research/serve_parallel_compile_cpu.md); whether the GPU's
    # compiles overlap is still to measure (benchmarks/research/decode_compile_probe.py
    # --parallel)
    parallel_compile: bool = False

    def unrolls(self, chunk: int) -> bool:
        """Whether this engine's prefill chunk of `chunk` tokens a row runs unrolled."""
        tokens = self.prefill_rows * chunk
        return jax.default_backend() == "gpu" and tokens <= self.unroll_chunk_tokens

    @property
    def interleaved_chunk_sizes(self) -> tuple[int, ...]:
        """The chunk lengths that may run while rows decode: decode_chunk_size, or with
        `itl_target_ms` also its doublings below chunk_size, and chunk_size."""
        smallest = self.decode_chunk_size or self.chunk_size
        if self.itl_target_ms is None:
            return (smallest,)
        sizes = [smallest]
        while sizes[-1] * 2 < self.chunk_size:
            sizes.append(sizes[-1] * 2)
        return tuple(sorted(set(sizes) | {self.chunk_size}))

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The prefill chunk lengths the engine runs (each one compiled program)."""
        return tuple(sorted({self.chunk_size, *self.interleaved_chunk_sizes}))

    def check(self) -> None:
        for name in ("max_batch", "max_len", "chunk_size", "prefill_rows", "decode_chunk_size"):
            value = getattr(self, name)
            if name == "decode_chunk_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if self.decode_chunk_size is not None and self.decode_chunk_size > self.chunk_size:
            raise ValueError(f"decode_chunk_size ({self.decode_chunk_size}) must be <= "
                             f"chunk_size ({self.chunk_size}): it is the smaller chunk that "
                             "runs between decode steps.")
        if isinstance(self.unroll_chunk_tokens, bool) or \
                not isinstance(self.unroll_chunk_tokens, int) or self.unroll_chunk_tokens < 0:
            raise ValueError(f"unroll_chunk_tokens must be an int >= 0, got "
                             f"{self.unroll_chunk_tokens!r}.")
        if self.itl_target_ms is not None:
            if isinstance(self.itl_target_ms, bool) or \
                    not isinstance(self.itl_target_ms, (int, float)) or self.itl_target_ms <= 0:
                raise ValueError(f"itl_target_ms must be a positive number of milliseconds, "
                                 f"got {self.itl_target_ms!r}.")
            if (self.decode_chunk_size or self.chunk_size) >= self.chunk_size:
                raise ValueError("itl_target_ms chooses among chunk lengths from "
                                 "decode_chunk_size up to chunk_size: set decode_chunk_size "
                                 "below chunk_size.")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}.")
        if self.prefill_rows > self.max_batch:
            raise ValueError(f"prefill_rows ({self.prefill_rows}) must be <= max_batch "
                             f"({self.max_batch}).")


# Weight of a new measurement in the running time of a program (`Engine._timed`).
TIME_SMOOTHING = 0.25


def pick_interleaved_chunk(sizes, chunk_ms: dict, budget_ms: float, remaining: int) -> int:
    """The chunk length to run while rows decode: of the `sizes` whose running time
    (`chunk_ms`, ms; unmeasured ones never fit) is within `budget_ms`, the smallest that
    holds the `remaining` prompt tokens, else the largest; the smallest size if none fits."""
    fitting = [n for n in sizes if chunk_ms.get(n, float("inf")) <= budget_ms]
    if not fitting:
        return min(sizes)
    holding = [n for n in fitting if n >= remaining]
    return min(holding) if holding else max(fitting)
