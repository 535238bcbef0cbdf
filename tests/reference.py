"""Independent float64 numpy transcriptions of SPEC, the oracles the implementations are tested
against.

Slow per-query loops written from the SPEC text alone (no shared code with the
implementations): `cca_reference` is SPEC sections 1-3, `causal_reference` plain causal
softmax attention (what properties 1 and 2 reduce CCA to), and `reference_directional_grads`
central finite differences of `cca_reference` (the gradient oracle of property 4).
"""

import numpy as np


def _softmax(x):
    x = x - x.max()
    e = np.exp(x)
    return e / e.sum()


def documents(segment_ids, b: int, length: int) -> list[tuple[int, int]]:
    """[start, end) of every document of row b: maximal runs of equal segment id."""
    seg = np.zeros(length, int) if segment_ids is None else np.asarray(segment_ids[b])
    starts = [t for t in range(length) if t == 0 or seg[t] != seg[t - 1]]
    return list(zip(starts, starts[1:] + [length]))


def cca_reference(q, k, v, g, s, pooling="cca", segment_ids=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, L, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for d0, d1 in documents(segment_ids, b, L):
            n = d1 - d0
            m = max(0, (n - s) // g)
            for h in range(Hq):
                kk, vv, qq = k[b, d0:d1, h // G], v[b, d0:d1, h // G], q[b, d0:d1, h]
                ck, cv = np.zeros((m, D)), np.zeros((m, D))
                for j in range(m):
                    grp = slice(j * g, (j + 1) * g)
                    if pooling == "cca":
                        a = _softmax(kk[grp] @ qq[(j + 1) * g - 1] / np.sqrt(D))
                        ck[j], cv[j] = a @ kk[grp], a @ vv[grp]
                    elif pooling == "mean":
                        ck[j], cv[j] = kk[grp].mean(0), vv[grp].mean(0)
                    else:
                        ck[j], cv[j] = kk[grp].max(0), vv[grp].max(0)
                for t in range(n):
                    nc = max(0, (t + 1 - s) // g)
                    keys = np.concatenate([ck[:nc], kk[g * nc:t + 1]])
                    vals = np.concatenate([cv[:nc], vv[g * nc:t + 1]])
                    p = _softmax(keys @ qq[t] / np.sqrt(D))
                    out[b, d0 + t, h] = p @ vals
    return out


def causal_reference(q, k, v):
    """Causal full softmax attention with GQA (query head h reads KV head h // G), float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, L, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            for t in range(L):
                p = _softmax(k[b, :t + 1, h // G] @ q[b, t, h] / np.sqrt(D))
                out[b, t, h] = p @ v[b, :t + 1, h // G]
    return out


def reference_directional_grads(q, k, v, cot, directions, *, g, s, pooling="cca",
                                segment_ids=None, step=1e-6):
    """d/de sum(cca_reference(x + e * dx) * cot) at e = 0 for each direction dx = (dq, dk, dv),
    by central differences in float64 (truncation error ~ step^2, round-off ~ 1e-16 / step)."""
    q, k, v, cot = (np.asarray(x, np.float64) for x in (q, k, v, cot))

    def loss(dq, dk, dv, e):
        out = cca_reference(q + e * dq, k + e * dk, v + e * dv, g, s, pooling, segment_ids)
        return np.sum(out * cot)

    return np.array([(loss(*d, step) - loss(*d, -step)) / (2 * step) for d in directions])
