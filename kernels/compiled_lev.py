"""LEV's recipe as leviathan.py writes it (LEV.recipe), through torch.compile: a fast path that
follows every edit of the recipe, since it is the recipe. The scripts put it where LEV's
hand-written kernels (fast_lev.py, lev_kernels.c) step aside, which are faster where they match
(docs/speed.md: Editing LEV, compiled).

torch.compile fuses the recipe's elementwise work (the 3 knots of each coordinate, the log and the
sign of the product) into a few passes around two batched matmuls; each chunk of ids is recomputed
in backward, so that memory stays at the kernels'. Fewer than a chunk of ids without gradients
(decoding's new ids) run eagerly: a compiled chunk of padding would cost more than it saves.
"""

import functools

import torch
import torch.nn.functional as F

from leviathan import RECIPE_CHUNK


class CompiledRecipe:
    """LEV.fast_embed: (lev, ids (U,) distinct) -> (U, n_embd), LEV.embed_distinct's function with
    LEV.recipe compiled: the last chunk is padded with id 0, so that every chunk has one shape, and
    one graph (per dtype, device and gradient mode) serves every batch."""

    name = "LEV's recipe compiled (kernels/compiled_lev.py)"

    def __init__(self):
        self.compiled = torch.compile(run_recipe, dynamic=False)

    def __call__(self, lev, ids):
        if len(ids) < RECIPE_CHUNK and not torch.is_grad_enabled():
            return lev.in_chunks(lev.recipe, ids)  # decoding's few new ids: eager, not padded
        n = len(ids)
        padded = F.pad(ids, (0, -n % RECIPE_CHUNK))
        return lev.in_chunks(functools.partial(self.compiled, lev), padded)[:n]


def run_recipe(lev, ids):
    """lev.recipe(ids), as a function of both: one compiled function serves any LEV (a copy with
    other weights too), recompiled only for another shape, dtype or class."""
    return lev.recipe(ids)
