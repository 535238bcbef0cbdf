"""Integer arithmetic on Python ints, numpy and jax.numpy arrays alike (traced or not): the
one switch between numpy and jax.numpy for the visibility modules of this package.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _xp(*values):
    """The one switch between numpy and jax.numpy here: numpy when every value is a Python
    or numpy integer/bool or a numpy array (host-side tables, tests), else jax.numpy."""
    host = all(isinstance(v, (int, np.integer, np.bool_, np.ndarray)) for v in values)
    return np if host else jnp


def _elementwise(name: str):
    """numpy/jax.numpy op `name` through `_xp`; Python scalars in, a Python scalar out."""
    def op(*args):
        out = getattr(_xp(*args), name)(*args)
        scalars = all(isinstance(a, (int, np.integer, np.bool_)) for a in args)
        return out.item() if scalars else out
    return op


_maximum = _elementwise("maximum")
_minimum = _elementwise("minimum")
_where = _elementwise("where")


def _cdiv(a, b):
    return (a + b - 1) // b


def _as_count(flag):
    """A bool (Python, numpy or traced) as the int 0 or 1."""
    return int(flag) if isinstance(flag, (bool, np.bool_)) else flag.astype(np.int32)
