"""Devices, dtypes and threads: what a script's --device and --dtype flags resolve to."""

import contextlib

import torch


def resolve_device(name):
    """'auto' -> cuda if available, else mps, else cpu; an explicit device must be available (else
    ValueError)."""
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device=cuda but torch sees no CUDA GPU; "
                         "use --device=cpu or --device=auto")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device=mps but this torch has no MPS (Apple GPU) support; "
                         "use --device=cpu or auto")
    if name not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device={name}; choose auto, cpu, cuda or mps")
    return name


def resolve_dtype(name, device_type):
    """'auto' -> bfloat16 on CUDA (float16 where bf16 is unsupported), float32 elsewhere; returns
    the name."""
    if name == "auto":
        if device_type != "cuda":
            return "float32"
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return name


def autocast(device_type, dtype_name):
    """The autocast context of a dtype name (nothing for float32)."""
    if dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, dtype_name))


def pick_threads(n_params):
    """Torch threads for a model of n_params parameters on CPU: one below 50M parameters, torch's
    default above. Small models gain little from threads, and when another process is busy, OpenMP
    threads that spin waiting for each other collapse decoding speed (docs/speed.md)."""
    return 1 if n_params < 50_000_000 else torch.get_num_threads()
