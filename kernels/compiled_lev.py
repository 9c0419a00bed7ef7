"""LEV's recipe as leviathan.py writes it (LEV.recipe), through torch.compile: a fast path that
follows every edit of the recipe, since it is the recipe. The scripts put it where LEV's
hand-written kernels (fast_lev.py, lev_kernels.c) step aside, which are faster where they match
(docs/speed.md: Editing LEV, compiled).

torch.compile fuses the recipe's elementwise work (the basis, the log and sign of the product, the
LayerNorm) into a few passes around its matmuls; each chunk of ids is recomputed in backward, so
that autograd holds one chunk's spline values, as with the kernels. sample.py does not install it:
a prompt's first pass would compile (~20 s on a cold cache), and each new token's id would be
padded to a whole chunk.
"""

import functools
import math

import torch


class CompiledRecipe:
    """LEV.fast_embed: (lev, ids (U,) distinct) -> (U, n_embd), LEV.embed_distinct's function with
    LEV.recipe compiled: the last chunk is padded (with its last id, computed once more), so that
    every chunk has one shape, and one graph (per dtype, device and gradient mode) serves every
    batch."""

    name = "LEV's recipe compiled (kernels/compiled_lev.py)"

    def __init__(self):
        self.compiled = None  # made on first use: torch.compile's machinery costs ~40 MiB

    def __call__(self, lev, ids):
        if self.compiled is None:
            self.compiled = torch.compile(run_recipe, dynamic=False)
        n = len(ids)
        padding = math.ceil(n / lev.recipe_chunk) * lev.recipe_chunk - n
        padded = torch.cat([ids, ids[-1:].expand(padding)])
        return lev.in_chunks(functools.partial(self.compiled, lev), padded)[:n]


def run_recipe(lev, ids):
    """lev.recipe(ids), as a function of both: one compiled function serves any LEV (a copy with
    other weights too), recompiled only for another shape, dtype or class."""
    return lev.recipe(ids)
