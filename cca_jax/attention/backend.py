"""What an attention backend is: one object per implementation, with its entry points and
one `supports` check.

Entry points (`ENTRIES`), each optional:
  attention  full sequences: `attention(q, k, v, pattern, pooling=, segment_ids=)`, the
             contract of `cca_jax.attention.run_attention`;
  blocked    per-row bounds over prepared slots: `blocked(q, k, v, ck, cv, raw_lo, core_lo,
             core_hi, blocking, window)`, the contract of `xla.blocked_attention` (prefill
             chunks at an offset, sequence-sharded chunks);
  decode     one query per row against the stacked KV cache: `decode(q, k_all, v_all, ck,
             cv, layer, pattern, positions)`, the contract of `cached.decode_attention_xla`.
`supports(...)` says in words why a backend refuses a call (None: it takes it), so the
resolver (`backends.resolve`) can both pick for `auto` and explain an explicit request that
cannot run. Each entry runs under `jax.named_scope("attention_<name>")`, so profiles show
which backend ran.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cca_jax.blocks import ATTENTION_KINDS, AttentionPattern

ENTRIES = ("attention", "blocked", "decode")
ALL_OPTIONS = tuple(ATTENTION_KINDS.values())


def platform_name(platform: str) -> str:
    """jax's backend names with "cuda" read as "gpu"."""
    return "gpu" if platform == "cuda" else platform


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention implementation.

    name: its `implementation=` string. platforms: jax backends it runs compiled on (None:
    every one); `auto` only picks it there. interprets_on_cpu: it also runs on the CPU
    backend through an interpreter (tests; never picked by `auto`). where: those platforms in
    words, for errors. entries: its entry points (`ENTRIES`). options: the attention option
    types it computes.
    """

    name: str
    platforms: tuple[str, ...] | None
    where: str
    entries: frozenset[str]
    interprets_on_cpu: bool = False
    options: tuple[type[AttentionPattern], ...] = ALL_OPTIONS

    def supports(self, option: AttentionPattern, platform: str, dtype, head_dim: int,
                 packed: bool, entry: str = "attention") -> str | None:
        """None if this backend runs `entry` for this call, else the reason it refuses.

        option: the attention option; platform: a jax backend name; dtype, head_dim: of q;
        packed: segment_ids given (several documents per row).
        """
        if entry not in ENTRIES:
            raise ValueError(f"entry must be one of {ENTRIES}, got {entry!r}.")
        if entry not in self.entries:
            return f"it has no {entry} entry (it has {sorted(self.entries)})"
        if type(option) not in self.options:
            return (f"it does not compute attention={option.kind!r}; it takes "
                    f"{sorted(o.kind for o in self.options)}")
        platform = platform_name(platform)
        if not self.runs_on(platform):
            return f"it runs on {self.where}, not on the {platform!r} backend"
        return self._refuses(option, platform, jnp.dtype(dtype), head_dim, packed, entry)

    def runs_on(self, platform: str, compiled: bool = False) -> bool:
        """Whether it runs on `platform` at all (compiled=True: not through an interpreter)."""
        platform = platform_name(platform)
        if self.platforms is None or platform in self.platforms:
            return True
        return not compiled and platform == "cpu" and self.interprets_on_cpu

    def require(self, option: AttentionPattern, platform: str, dtype, head_dim: int,
                packed: bool, entry: str = "attention") -> None:
        """ValueError with the reason and the fix unless `supports(...)` is None."""
        reason = self.supports(option, platform, dtype, head_dim, packed, entry)
        if reason is not None:
            raise ValueError(
                f"implementation={self.name!r} cannot run this call ({entry}, "
                f"attention={option.kind!r}, head_dim={head_dim}, {jnp.dtype(dtype).name}"
                f"{', packed rows' if packed else ''}): {reason}. Use implementation='auto' "
                "(it picks one that can) or implementation='xla' (every option, dtype and "
                "platform).")

    def _refuses(self, option, platform: str, dtype, head_dim: int, packed: bool,
                 entry: str) -> str | None:
        """Backend-specific refusals after the entry, option and platform checks."""
        return None

    def defers_in_auto(self, option, platform: str, dtype, head_dim: int, packed: bool,
                       entry: str = "attention") -> str | None:
        """Why `auto` passes over a call this backend supports (another one is known to
        serve it better), or None. An explicit request still runs it."""
        return None

    def slots_to_pool(self, slots: int, head_dim: int) -> int:
        """How many slots a caller of `blocked` should pool when it needs `slots`: more where
        the kernels would otherwise zero-pad the slot axis to whole blocks (a copy); a row
        reads only its visible slots, so the extra ones change nothing."""
        return slots

    def reads_slots_in_cache(self, dtype, head_dim: int, slots: int) -> bool:
        """Whether `blocked_in_cache` takes a KV cache's stacked slots of this dtype, head dim
        and slot count in place; where not, the caller slices a layer's slots for `blocked`
        (the same result, through a copy)."""
        return False

    # ---- entry points: the named scope here, the work in the subclasses' `_` methods ----

    def attention(self, q, k, v, pattern: AttentionPattern, *, pooling: str, segment_ids):
        with jax.named_scope(f"attention_{self.name}"):
            return self._attention(q, k, v, pattern, pooling=pooling, segment_ids=segment_ids)

    def blocked(self, q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window=None):
        with jax.named_scope(f"attention_{self.name}"):
            return self._blocked(q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window)

    def blocked_in_cache(self, q, k, v, ck_cache, cv_cache, layer, cache_rows, raw_lo, core_lo,
                         core_hi, blocking, window=None, first_row: int = 0):
        """`blocked` with the slots of q's row b read in place at `ck_cache[layer,
        cache_rows[b]]` from a KV cache's stacked `[layers, rows, C, Hq, D]` slots, the output
        of rows `[first_row, L)` only (a prefill chunk's, after its ring rows); only where
        `reads_slots_in_cache` says so. Inference (prefill chunks): no gradient."""
        with jax.named_scope(f"attention_{self.name}"):
            return self._blocked_in_cache(q, k, v, ck_cache, cv_cache, layer, cache_rows,
                                          raw_lo, core_lo, core_hi, blocking, window,
                                          first_row)

    def decode(self, q, k_all, v_all, ck, cv, layer, pattern: AttentionPattern, positions):
        with jax.named_scope(f"attention_{self.name}"):
            return self._decode(q, k_all, v_all, ck, cv, layer, pattern, positions)

    def _attention(self, q, k, v, pattern, *, pooling, segment_ids):
        raise NotImplementedError(f"{self.name} has no attention entry")

    def _blocked(self, q, k, v, ck, cv, raw_lo, core_lo, core_hi, blocking, window):
        raise NotImplementedError(f"{self.name} has no blocked entry")

    def _blocked_in_cache(self, q, k, v, ck_cache, cv_cache, layer, cache_rows, raw_lo,
                          core_lo, core_hi, blocking, window, first_row):
        raise NotImplementedError(f"{self.name} reads no slots in a cache")

    def _decode(self, q, k_all, v_all, ck, cv, layer, pattern, positions):
        raise NotImplementedError(f"{self.name} has no decode entry")
