"""`benchmarks/research/hlo_big_values.py`: the tool that finds a copied cache in a GPU run's
optimized HLO, checked on CPU programs whose copies are known."""

import jax
import jax.numpy as jnp

from benchmarks.research.hlo_big_values import aliases, big_values, report


def _compiled_text(keep_old: bool) -> str:
    def f(x, y):
        new = jax.lax.dynamic_update_slice(x, y, (3, 0))
        return (new, x) if keep_old else new          # keeping both needs a copy of x
    args = (jnp.zeros((1024, 256), jnp.float32), jnp.ones((4, 256), jnp.float32))
    return jax.jit(f, donate_argnums=0).lower(*args).compile().as_text()


def test_an_in_place_update_makes_no_copy_and_aliases_its_input():
    text = _compiled_text(keep_old=False)
    assert [v["opcode"] for v in big_values(text, 2**20)] in ([], ["fusion"],
                                                               ["dynamic-update-slice"])
    assert aliases(text) == [("", 0, "may-alias")]


def test_keeping_the_old_array_shows_its_copy():
    text = _compiled_text(keep_old=True)
    made = big_values(text, 2**20)
    assert any(v["opcode"] == "copy" and v["shape"] == (1024, 256) for v in made), made
    assert "1.0 MiB  copy" in report(text, 2**20, 10)
