"""What the kv-cache tests share: a tiny float32 model per attention option (built once per
process), its full-forward logits, and the cache comparison with its float32 tolerance."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cca_jax.config import LlamaConfig
from cca_jax.kv_cache import KVCache, init_cache
from cca_jax.model import LlamaForCausalLM
from cca_jax.prefill import prefill

TINY = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   dtype="float32", param_dtype="float32",
                   attention={"implementation": "naive"})
OPTIONS = {
    "cca": dict(attention="cca", group_size=4, window_size=6),   # G = 2, s % g != 0
    "full": dict(attention="full"),
    "sliding": dict(attention="sliding", window_size=5),
    "streaming": dict(attention="streaming", window_size=5, sink_tokens=2),
    "cca_s_below_g": dict(attention="cca", group_size=5, window_size=3),
}
SLOW_OPTIONS = {"cca_s_below_g"}
MAX_LEN = 32
WEIGHT_SCALE = 4.0
SEQ = 29
ROW_LENGTHS = np.array([29, 18, 24])       # total tokens per row
PROMPT_LENGTHS = np.array([5, 9, 0])       # prefilled before decoding (row 2: decode only)
LOGIT_TOL = 2e-5
# Cache entries written by differently shaped programs (chunks of 1, 7, the whole prompt)
# differ by float32 summation order: measured up to 1.3e-5 on entries up to 6.3 (about 25
# ulps; 1.07e-5 in cca with chunks of 1). Allowed: 4e-6 of the array's largest entry
# (about 34 ulps there); a misplaced entry or slot is off by O(1).
CACHE_RTOL = 4e-6


def sharpen(model: LlamaForCausalLM) -> None:
    """Scale every weight matrix by WEIGHT_SCALE: sharper attention than the 0.02 init, so
    pooling weights and windows matter in the logits (cca vs mean pooling differ by ~2 at
    scale 4, ~4e-4 at scale 1)."""
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p * WEIGHT_SCALE if p.ndim > 1 else p, params))


class Setup:
    """Option `name` on TINY with sharpened weights, three rows of token ids and their full
    forward (`naive` attention) logits `ref`."""

    def __init__(self, name):
        self.name = name
        self.cfg = TINY.replace(**OPTIONS[name])
        self.model = LlamaForCausalLM(self.cfg, rngs=nnx.Rngs(0))
        sharpen(self.model)
        rng = np.random.default_rng(1)
        self.ids = rng.integers(0, self.cfg.vocab_size, (3, SEQ)).astype(np.int32)
        graphdef, state = nnx.split(self.model)
        forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids))
        self.ref = np.asarray(forward(state, jnp.asarray(self.ids)))   # [3, SEQ, V]
        self._one = None

    def one_prefill(self):
        """One prefill of every row (one chunk): (cache, logits [3, SEQ, V])."""
        if self._one is None:
            cache = init_cache(self.cfg, 3, MAX_LEN)
            cache, _, logits = prefill(self.model, cache, self.ids, ROW_LENGTHS,
                                       chunk_size=SEQ, return_all_logits=True)
            self._one = (jax.tree.map(np.asarray, cache), np.asarray(logits))
        return self._one


@functools.cache
def get_setup(name: str) -> Setup:
    """One Setup per option for the whole process (its compiled functions are reused by
    every kv-cache test module on the worker)."""
    return Setup(name)


def assert_caches_equal(got: KVCache, want: KVCache, rtol=CACHE_RTOL) -> float:
    """The largest difference of any cache array, checked against `rtol` of that array's
    largest entry; returns the largest difference."""
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    err = 0.0
    for name in ("k", "v", "ck", "cv"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert a.shape == b.shape
        if a.size:
            diff = float(np.abs(a - b).max())
            assert diff <= rtol * max(float(np.abs(b).max()), 1.0), (name, diff)
            err = max(err, diff)
    return err
