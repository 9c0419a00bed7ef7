"""A run's settings of the model: which fast paths it uses. Each is the same function as the plain
code of leviathan.py (tests/test_fast_paths.py trains with all of them off and on: the same losses
in float64).

The model file leaves three hooks at None, and runs as written: LEV.fast_embed (fast_lev.py),
GPT.fast_loss (lean_head.py) and GPT.fast_decoding (decoder.py). The scripts install them here. They
are settings of a run, not of the architecture: kept out of Config and checkpoints.
"""

import torch

from machinery.decoder import FastDecoding
from machinery.fast_lev import FastEmbedder
from machinery.fast_path_check import check_fast_paths, say_on_stderr
from machinery.lean_head import linear_cross_entropy


def set_runtime(model, lev_fast=True, lev_chunk=64, lev_c_kernels=True, lev_compile=True,
                lean_head=False, fast_decoding=True, compile_decode=False, lev_cache=True,
                check=True, say=say_on_stderr):
    """Install (or remove) the fast paths of a model; each call sets all of them. The defaults are
    what a model of this project has always run with when nothing else was said: LEV's fast path,
    the plain head (the loss with all the logits; train.py turns the lean head on) and the fast
    decoder.

      lev_fast: LEV's fast path (lev arm only); lev_chunk, lev_c_kernels, lev_compile: its settings
        (FastEmbedder). False: LEV's recipe exactly as leviathan.py writes it.
      lean_head: the loss from linear_cross_entropy, which never holds all the logits.
      fast_decoding: generation's one-token steps through the Decoder, with the head laid out for
        them; lev_cache: there, each id's LEV embedding computed once per call; compile_decode: the
        one-token steps through torch.compile (GPT.backbone compiled) in place of the Decoder.
      check: check each fast path against the model's own code as it stands, on the model's device
        (fast_path_check.py): one that differs (leviathan.py was edited) is removed, with one line
        through say. Install on the model where it will run, after its weights are loaded.
    """
    if model.config.embedding == "lev":
        model.tok_emb.fast_embed = (FastEmbedder(lev_chunk, lev_c_kernels, lev_compile) if lev_fast
                                    else None)
    model.fast_loss = linear_cross_entropy if lean_head else None
    compiled = torch.compile(model.backbone) if compile_decode else None
    model.fast_decoding = FastDecoding(lev_cache, compiled) if fast_decoding else None
    if check:
        check_fast_paths(model, say)
    return model
