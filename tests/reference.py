"""An independent, per-query transcription of SPEC sections 1-3 in float64 numpy.

Slow loops, written from the SPEC text alone (no shared code with the implementations): the
oracle every CCA implementation is tested against.
"""

import numpy as np


def _softmax(x):
    x = x - x.max()
    e = np.exp(x)
    return e / e.sum()


def cca_reference(q, k, v, g, s, pooling="cca", segment_ids=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, L, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        # Documents: maximal runs of equal segment id.
        seg = np.zeros(L, int) if segment_ids is None else np.asarray(segment_ids[b])
        starts = [t for t in range(L) if t == 0 or seg[t] != seg[t - 1]]
        bounds = list(zip(starts, starts[1:] + [L]))
        for d0, d1 in bounds:
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
