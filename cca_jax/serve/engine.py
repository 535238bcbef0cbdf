"""Continuous batching over one batched KV cache: the scheduler behind the server.

One `KVCache` of `max_batch` rows x `max_len` positions lives for the engine's lifetime. A
request waits in a bounded queue until a row is free, then owns that row until it ends (end
of sequence, `max_tokens`, or a cancel: a stop string or a client that went away, decided by
the caller). One engine thread runs the device; each turn of its loop is

    admit waiting requests into free rows (their lengths reset to 0: nothing else is cleared,
        since a row's stale entries lie at positions its queries never see);
    at most ONE prefill chunk: the next prompt tokens of up to `prefill_rows` requests still
        in their prompts (oldest first): `decode_chunk_size` of them while some row is
        decoding (with `itl_target_ms`, the largest compiled length whose measured time
        keeps the turn within the target: `pick_interleaved_chunk`), `chunk_size` while none
        is; through the P rows only
        (`prefill_chunk(rows=...)`: read and written in place, layer by layer; with P = B
        the whole cache runs), their first tokens sampled in the same program;
    ONE decode step of every row past its prompt (`decode_step` over all B rows, the idle and
        prefilling ones inactive), the next tokens sampled per row (`sample_rows`).

So a long prompt delays the running rows by one chunk per token at most (the inter-token
time is one decode step plus at most one `decode_chunk_size` chunk), a prompt that arrives
while nothing decodes is prefilled in the larger chunks at full throughput, and a new request
waits for at most one decode step before its prefill starts. Every program has one shape
whatever the occupancy (B rows, P rows, the chunk lengths): they are all compiled (or
loaded from the persistent compilation cache) by `start()` before `ready` is set, and no
request compiles anything (`compilations_since_ready` counts XLA compilations to prove it).

Per row the tokens depend only on its own request: the decode step and the prefill compute
each row from its own cache row (batch-invariant), and a row samples with the key of its own
seed and token index, as `generate(seed=...)` does. The host reads the tokens back after
every step (no pipelining: a finished row must stop feeding tokens at once).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable

import jax
import numpy as np

from cca_jax import blocks
from cca_jax.kv_cache import cache_bytes, init_cache
from cca_jax.sampling import check_sampling
from cca_jax.serve import programs
from cca_jax.serve.engine_config import TIME_SMOOTHING, EngineConfig, pick_interleaved_chunk
from cca_jax.sharding import mesh_context

log = logging.getLogger("cca_jax.serve")


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"   # compiled or loaded
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"          # loaded from the disk cache


class QueueFull(Exception):
    """Every row is busy and `max_queue` requests already wait: try again later."""


class EngineStopped(Exception):
    """The engine is shutting down (or failed) and takes no new requests."""


@dataclasses.dataclass
class Request:
    """One generation: prompt token ids and sampling settings (`sampling.sample` rules)."""
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_at_eos: bool = True
    # None: no logprobs; n >= 0: each token's logprob and the n likeliest alternatives'
    logprobs: int | None = None


@dataclasses.dataclass
class StepTimes:
    """What the device did since the engine was ready, timed on the host around each program
    (tokens read back included): prefill chunks and the prompt tokens they carried, decode
    steps and the tokens they produced (active rows). Their ratios separate the decode
    throughput of the batch from the prefill work interleaved with it. `interleaved_*`: the
    prefill chunks that ran while rows were decoding (the interleaved ones, the inter-token
    delay they add), also counted in `prefill_*`. `turns`, `turn_seconds`: the loop's busy
    turns and their wall time, so that what the host adds per turn (admission, bookkeeping,
    handing tokens to the requests) is `turn_seconds - prefill_seconds - decode_seconds`."""
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    interleaved_chunks: int = 0
    interleaved_tokens: int = 0
    interleaved_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    turns: int = 0
    turn_seconds: float = 0.0


# on_event(token, None) for every generated token (an end-of-sequence token is not passed),
# then on_event(None, reason) once: "stop" (end of sequence), "length" (max_tokens),
# "cancelled" or "error". For a request with `logprobs`, a token's event carries a third
# argument, its `programs.TokenLogprobs`. Called on the engine thread: it must return quickly.
EventCallback = Callable[..., None]


@dataclasses.dataclass(eq=False)
class Sequence:
    """A submitted request's state in the engine (the handle `submit` returns)."""
    request: Request
    on_event: EventCallback
    number: int
    row: int = -1
    prefilled: int = 0          # prompt tokens in the cache
    generated: int = 0          # tokens sampled so far
    last_token: int = 0
    cancelled: bool = False
    finish_reason: str | None = None
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)


class Engine:
    """The scheduler (module docstring). `start()`, then `submit()` from any thread;
    `shutdown()` ends it. `eos`: token ids that end a sequence (default the config's).
    `mesh`: run over several devices, parameters and cache placed by the logical-axis table
    of `cca_jax.sharding` (rows over data x fsdp, heads over tensor), as `generate` does.
    On a GPU, pass `cca_jax.model.inference_layers(model)`, as the server does: its decode
    programs then compile about 6x faster (XLA tunes each GEMM once, not once per layer)."""

    def __init__(self, model, config: EngineConfig = EngineConfig(), eos=None, mesh=None):
        from flax import nnx

        config.check()
        self.mesh = mesh
        if mesh is not None:
            from cca_jax.sharding import shard_model
            shard_model(model, mesh)
        cfg = model.config
        if config.max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len={config.max_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}: lower "
                             "it, or load the model with a larger max_position_embeddings.")
        cfg.check_length(config.max_len)
        self.model, self.config = model, config
        eos = cfg.eos_token_id if eos is None else eos
        self.eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self._model_state = nnx.split(model)
        self._cache = None
        self._pattern = cfg.attention.pattern
        self._rows: list[Sequence | None] = [None] * config.max_batch
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._cond = threading.Condition()
        self._numbers = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.ready = threading.Event()
        self.stopped = threading.Event()    # the engine thread has ended (see `error`)
        self.error: BaseException | None = None
        self.startup_seconds = 0.0
        self.compilations_at_startup = 0
        self.cache_hits_at_startup = 0
        self.compilations_since_ready = 0
        self.max_rows_busy = 0
        self.finished = collections.Counter()
        self.step_times = StepTimes()
        # running ms of each program the engine times (`_timed`): "decode" (the step without
        # pooling) and each prefill chunk length
        self._program_ms: dict = {}

    # ---- the public side (any thread) ------------------------------------------------------

    @property
    def kv_cache_bytes(self) -> int:
        from cca_jax.kv_cache import cache_shapes
        return cache_bytes(cache_shapes(self.model.config, self.config.max_batch,
                                        self.config.max_len))

    def check_request(self, request: Request) -> None:
        """ValueError naming the parameter for a request the engine cannot run."""
        prompt = request.prompt
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token.")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab}).")
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int) \
                or request.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {request.max_tokens!r}.")
        check_sampling(request.temperature, request.top_k, request.top_p)
        n = request.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)
                              or not 0 <= n <= programs.TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int from 0 to {programs.TOP_LOGPROBS}, "
                             f"got {n!r}.")
        need = len(prompt) + request.max_tokens
        if need > self.config.max_len:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_tokens "
                             f"({request.max_tokens}) is {need} tokens, more than this "
                             f"server's max_len of {self.config.max_len}: shorten the prompt "
                             "or ask for fewer tokens.")

    def submit(self, request: Request, on_event: EventCallback) -> Sequence:
        """Queue a request (checked: ValueError); QueueFull when `max_queue` already wait,
        EngineStopped after shutdown. Its events arrive through `on_event`."""
        self.check_request(request)
        with self._cond:
            if self._stopping or self.error is not None:
                raise EngineStopped("the server is shutting down." if self.error is None
                                    else f"the engine failed: {self.error}")
            free = sum(s is None for s in self._rows)
            if len(self._waiting) >= self.config.max_queue + free:
                raise QueueFull(f"{len(self._waiting)} requests already wait for one of "
                                f"{self.config.max_batch} rows.")
            seq = Sequence(request, on_event, next(self._numbers))
            self._waiting.append(seq)
            self._cond.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """End a request early (a stop string, a client gone); its row is freed before the
        next step. Harmless when it already finished."""
        with self._cond:
            seq.cancelled = True
            self._cond.notify()

    def stats(self) -> dict:
        with self._cond:
            busy = sum(s is not None for s in self._rows)
            return {"rows": self.config.max_batch, "rows_busy": busy,
                    "queued": len(self._waiting), "max_rows_busy": self.max_rows_busy,
                    "compilations_at_startup": self.compilations_at_startup,
                    "cache_hits_at_startup": self.cache_hits_at_startup,
                    "compilations_since_ready": self.compilations_since_ready,
                    "startup_seconds": round(self.startup_seconds, 3),
                    "finished": dict(self.finished),
                    "step_times": dataclasses.asdict(self.step_times),
                    "program_ms": {str(k): round(v, 3) for k, v in self._program_ms.items()}}

    def start(self) -> None:
        """Start the engine thread: it compiles every program, sets `ready`, then serves."""
        jax.monitoring.register_event_duration_secs_listener(self._on_jax_event)
        jax.monitoring.register_event_listener(self._on_cache_event)
        self._thread = threading.Thread(target=self._main, name="cca-jax-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop: requests still queued or running end with "cancelled"; waits for the
        thread (up to `timeout` seconds)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        jax.monitoring.unregister_event_duration_listener(self._on_jax_event)
        jax.monitoring.unregister_event_listener(self._on_cache_event)

    # ---- the engine thread ------------------------------------------------------------------

    def _on_cache_event(self, name: str, **kwargs) -> None:
        if name == CACHE_HIT_EVENT and not self.ready.is_set():
            self.cache_hits_at_startup += 1

    def _on_jax_event(self, name: str, seconds: float, **kwargs) -> None:
        """Counts programs compiled (or loaded from the persistent cache: a load is counted
        too, since jit's in-memory cache missed)."""
        if name == COMPILE_EVENT:
            if self.ready.is_set():
                self.compilations_since_ready += 1
            else:
                self.compilations_at_startup += 1

    def _main(self) -> None:
        start = time.perf_counter()
        try:
            self._cache = self._new_cache()
            self._warm_up()
            self.startup_seconds = time.perf_counter() - start
            self.ready.set()
            log.info("engine ready in %.1f s", self.startup_seconds)
            while self._turn():
                pass
        except BaseException as e:  # noqa: BLE001  (report, fail every request, stop)
            log.exception("the engine failed")
            self.error = e
            self._end_all("error")
            self.stopped.set()
            return
        self._end_all("cancelled")
        self.stopped.set()

    def _new_cache(self):
        cfg, b, n = self.model.config, self.config.max_batch, self.config.max_len
        sharding = None
        if self.mesh is not None:
            from cca_jax.kv_cache import cache_shapes
            from cca_jax.sharding import cache_shardings
            sharding = cache_shardings(cache_shapes(cfg, b, n), self.mesh)
        return init_cache(cfg, b, n, sharding=sharding)

    def _warm_up(self) -> None:
        """Run each program once on inputs that change nothing (no active row, no valid
        token), so that every one is compiled before the first request (with
        `parallel_compile`, the prefill and decode programs all at once first)."""
        b, p = self.config.max_batch, self.config.prefill_rows
        self._cache = programs.reset_rows(self._cache, np.zeros(b, bool))
        rows = None if p == b else np.arange(p, dtype=np.int32)
        if self.config.parallel_compile:
            self._compile_at_once(rows)
        # With an inter-token target, each program runs once more, timed: the running
        # times the chunk choice starts from (the first call compiled).
        runs = 2 if self.config.itl_target_ms is not None else 1
        for chunk in self.config.chunk_sizes:
            for run in range(runs):
                begin = time.perf_counter()
                self._run_prefill(rows, np.zeros((p, chunk), np.int32), np.zeros(p, np.int32),
                                  [None] * p, warm_up=True)
                if run:
                    self._timed(chunk, time.perf_counter() - begin)
        for pool in self._pool_programs():
            for run in range(runs):
                begin = time.perf_counter()
                self._run_decode(np.zeros(b, bool), [None] * b, pool, warm_up=True)
                if run and not pool:
                    self._timed("decode", time.perf_counter() - begin)

    def _timed(self, program, seconds: float) -> None:
        """Fold one measured call of `program` (a chunk length, or "decode") into its
        running time in ms."""
        with self._cond:   # stats() reads them from other threads
            ms, old = seconds * 1e3, self._program_ms.get(program)
            self._program_ms[program] = ms if old is None else \
                old + TIME_SMOOTHING * (ms - old)

    def _compile_at_once(self, rows) -> None:
        """Lower the prefill and decode programs with the warm-up's arguments (one by one:
        tracing holds the GIL), then compile them in threads at once; jit's cache then
        holds them for the warm-up's calls."""
        import concurrent.futures
        b, p = self.config.max_batch, self.config.prefill_rows
        lowered = []
        with mesh_context(self.mesh):
            for chunk in self.config.chunk_sizes:
                lowered.append(programs.prefill_and_sample.lower(
                    self._model_state, self._cache, rows, np.zeros((p, chunk), np.int32),
                    np.zeros(p, np.int32), *self._settings([None] * p),
                    unroll=self.config.unrolls(chunk)))
            zeros = np.zeros(b, np.int32)
            seeds, *sampling = self._settings([None] * b)
            for pool in self._pool_programs():
                lowered.append(programs.decode_and_sample.lower(
                    self._model_state, self._cache, zeros, np.zeros(b, bool), seeds, zeros,
                    *sampling, pool_slots=pool))
        with concurrent.futures.ThreadPoolExecutor(len(lowered)) as threads:
            list(threads.map(lambda program: program.compile(), lowered))

    def _pool_programs(self) -> list[bool]:
        """The decode programs this cache can need: without pooling, and with it if some
        position completes a slot the cache stores."""
        slots = self._cache.num_slots
        if not slots:
            return [False]
        t = np.arange(self.config.max_len)
        return [False] + ([True] if blocks.completes_slot(self._pattern, t, slots).any()
                          else [])

    def _turn(self) -> bool:
        """One turn of the loop (module docstring); False when it is time to stop."""
        with self._cond:
            while not (self._stopping or self._waiting or any(self._rows)):
                self._cond.wait()
            if self._stopping:
                return False
            begin = time.perf_counter()
            self._drop_cancelled()
            admitted = self._admit()
        if admitted:
            mask = np.zeros(self.config.max_batch, bool)
            mask[[s.row for s in admitted]] = True
            self._cache = programs.reset_rows(self._cache, mask)
        self._prefill_once()
        self._decode_once()
        self._count(turns=1, turn_seconds=time.perf_counter() - begin)
        return True

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._waiting if s.cancelled]:
            self._waiting.remove(seq)
            self._finish(seq, "cancelled")
        for seq in self._rows:
            if seq is not None and seq.cancelled:
                self._finish(seq, "cancelled")

    def _admit(self) -> list[Sequence]:
        admitted = []
        for row, seq in enumerate(self._rows):
            if seq is None and self._waiting:
                seq = self._waiting.popleft()
                seq.row = row
                self._rows[row] = seq
                admitted.append(seq)
        busy = sum(s is not None for s in self._rows)
        self.max_rows_busy = max(self.max_rows_busy, busy)
        return admitted

    def _settings(self, seqs):
        """Per-row sampling arrays; None entries (no request) are greedy."""
        reqs = [s.request if s is not None else None for s in seqs]
        seeds = np.array([r.seed if r else 0 for r in reqs], np.int32)
        temperature = np.array([r.temperature if r else 0.0 for r in reqs], np.float32)
        top_k = np.array([(r.top_k or 0) if r else 0 for r in reqs], np.int32)
        top_p = np.array([(r.top_p if r and r.top_p is not None else 1.0) for r in reqs],
                         np.float32)
        return seeds, temperature, top_k, top_p

    def _run_prefill(self, rows, ids, n_valid, seqs, warm_up: bool = False):
        with mesh_context(self.mesh):   # activation constraints; part of jit's cache key
            tokens, logits, self._cache = programs.prefill_and_sample(
                self._model_state, self._cache, rows, ids, n_valid, *self._settings(seqs),
                unroll=self.config.unrolls(ids.shape[1]))
            logprobs = programs.fetch_logprobs(logits, tokens, seqs, force=warm_up)
        return np.asarray(tokens), logprobs

    def _run_decode(self, active, seqs, pool, warm_up: bool = False):
        tokens = np.array([s.last_token if s is not None else 0 for s in seqs], np.int32)
        steps = np.array([s.generated if s is not None else 0 for s in seqs], np.int32)
        seeds, temperature, top_k, top_p = self._settings(seqs)
        with mesh_context(self.mesh):
            out, logits, self._cache = programs.decode_and_sample(
                self._model_state, self._cache, tokens, active, seeds, steps, temperature,
                top_k, top_p, pool_slots=pool)
            logprobs = programs.fetch_logprobs(logits, out, seqs, force=warm_up)
        return np.asarray(out), logprobs

    def _prefill_once(self) -> None:
        pending = sorted((s for s in self._rows if s is not None
                          and s.prefilled < len(s.request.prompt)), key=lambda s: s.number)
        if not pending:
            return
        p, chunk = self.config.prefill_rows, self.config.chunk_size
        decoding = any(s is not None and s.prefilled == len(s.request.prompt)
                       for s in self._rows)
        batch = pending[:p]
        if decoding:
            chunk = self._interleaved_chunk(batch)
        if p == self.config.max_batch:   # every row: the whole cache, no rows copied
            slots = [s.row for s in batch]
            rows, seqs = None, [None] * p
        else:   # the P rows, then other rows (no tokens: unchanged) to make up P
            taken = {s.row for s in batch}
            fillers = [r for r in range(self.config.max_batch) if r not in taken]
            slots = list(range(len(batch)))
            rows = np.array([s.row for s in batch] + fillers[:p - len(batch)], np.int32)
            seqs = [None] * p
        ids = np.zeros((p, chunk), np.int32)
        n_valid = np.zeros(p, np.int32)
        for i, seq in zip(slots, batch):
            part = seq.request.prompt[seq.prefilled:seq.prefilled + chunk]
            ids[i, :len(part)] = part
            n_valid[i] = len(part)
            seqs[i] = seq
        begin = time.perf_counter()
        tokens, logprobs = self._run_prefill(rows, ids, n_valid, seqs)
        seconds, tokens_in = time.perf_counter() - begin, int(n_valid.sum())
        self._timed(chunk, seconds)
        self._count(prefill_chunks=1, prefill_tokens=tokens_in, prefill_seconds=seconds)
        if decoding:
            self._count(interleaved_chunks=1, interleaved_tokens=tokens_in,
                        interleaved_seconds=seconds)
        for i, seq in zip(slots, batch):
            seq.prefilled += int(n_valid[i])
            if seq.prefilled == len(seq.request.prompt):
                self._take_token(seq, int(tokens[i]), programs.row_logprobs(logprobs, i, seq))

    def _interleaved_chunk(self, batch) -> int:
        """The chunk length while rows decode: decode_chunk_size, or with `itl_target_ms`
        the `pick_interleaved_chunk` for the turn's time left after a decode step."""
        sizes = self.config.interleaved_chunk_sizes
        if self.config.itl_target_ms is None:
            return sizes[0]
        budget = self.config.itl_target_ms - self._program_ms.get("decode", 0.0)
        remaining = max(len(s.request.prompt) - s.prefilled for s in batch)
        return pick_interleaved_chunk(sizes, self._program_ms, budget, remaining)

    def _decode_once(self) -> None:
        seqs = [s if s is not None and s.prefilled == len(s.request.prompt) else None
                for s in self._rows]
        active = np.array([s is not None for s in seqs])
        if not active.any():
            return
        positions = np.array([len(s.request.prompt) + s.generated - 1 for s in seqs
                              if s is not None])
        pool = bool(self._cache.num_slots and blocks.completes_slot(
            self._pattern, positions, self._cache.num_slots).any())
        begin = time.perf_counter()
        tokens, logprobs = self._run_decode(active, seqs, pool)
        seconds = time.perf_counter() - begin
        if not pool:    # the step most turns run (pooling ones are rarer and longer)
            self._timed("decode", seconds)
        self._count(decode_steps=1, decode_tokens=int(active.sum()), decode_seconds=seconds)
        for row in np.flatnonzero(active):
            self._take_token(seqs[row], int(tokens[row]),
                             programs.row_logprobs(logprobs, row, seqs[row]))

    def _count(self, **amounts) -> None:
        with self._cond:   # stats() reads them from other threads
            for name, amount in amounts.items():
                setattr(self.step_times, name, getattr(self.step_times, name) + amount)

    def _take_token(self, seq: Sequence, token: int, logprobs=None) -> None:
        """A row's newly sampled token (with its `TokenLogprobs` if the request asked): pass
        it on, or end the row."""
        seq.generated += 1
        seq.last_token = token
        if seq.cancelled:
            self._finish(seq, "cancelled")
        elif seq.request.stop_at_eos and token in self.eos:
            self._finish(seq, "stop")
        else:
            self._notify(seq, token, None, logprobs)
            if seq.generated >= seq.request.max_tokens:
                self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        if 0 <= seq.row < len(self._rows) and self._rows[seq.row] is seq:
            self._rows[seq.row] = None
        self.finished[reason] += 1
        self._notify(seq, None, reason)

    def _notify(self, seq: Sequence, token, reason, logprobs=None) -> None:
        try:
            if logprobs is None:
                seq.on_event(token, reason)
            else:
                seq.on_event(token, reason, logprobs)
        except Exception:  # noqa: BLE001  (a listener's failure must not stop the engine)
            log.exception("request %d: its event listener failed", seq.number)

    def _end_all(self, reason: str) -> None:
        with self._cond:
            self._stopping = True
            for seq in list(self._waiting) + [s for s in self._rows if s is not None]:
                self._finish(seq, reason)
            self._waiting.clear()
