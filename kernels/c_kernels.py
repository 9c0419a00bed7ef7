"""LEV's C kernels: SplineProduct's forward and backward (fast_lev.py's torch kernels) as C loops
ordered for a CPU, in lev_kernels.c beside this file; tested equal to LEV.reference, values and
gradients in float64 (tests/test_fast_lev.py). Built once per machine with the system's C compiler
into a cache folder and loaded with ctypes. Built with OpenMP, the library runs on the OpenMP
runtime torch has loaded, torch.get_num_threads() threads; without it, on one.
"""

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

C_SOURCE = Path(__file__).with_name("lev_kernels.c")
C_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC")
C_TYPES = {torch.float32: "f32", torch.float64: "f64"}
_c_state = {}  # "library": the loaded library, or None where it could not be built (said once)


def c_library():
    """lev_kernels.c as a ctypes library, built on first use (CC or cc; LEVIATHAN_CACHE or
    ~/.cache/leviathan holds it, named by a hash of the source, the flags and the machine). None,
    with one line on stderr, where it cannot be built: LEV then runs torch's kernels."""
    if "library" not in _c_state:
        try:
            _c_state["library"] = load_c_library(build_c_library())
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _c_state["library"] = None  # RuntimeError: no home
            print(f"LEV: could not build its C kernels, so torch's kernels run instead (~3x slower "
                  f"on CPU): {build_failure(error)}", file=sys.stderr, flush=True)
    return _c_state["library"]


def build_failure(error):
    """Why the build failed and what to do, in one line: the compiler's first error, whole."""
    skip = "or pass --lev_c_kernels=False to skip the attempt"
    if isinstance(error, subprocess.CalledProcessError):
        lines = (error.stderr or "").splitlines()
        reason = next((line.split("error:", 1)[1].strip() for line in lines if "error:" in line),
                      f"it exited with status {error.returncode}")
        return f"the C compiler failed ({reason}); set CC to a working C compiler, {skip}"
    if isinstance(error, FileNotFoundError) and error.filename == compiler_command()[0]:
        return f"no C compiler ({error.filename}); install one (or set CC), {skip}"
    if isinstance(error, OSError) and error.filename:  # the cache folder
        return (f"cannot write {error.filename} ({error.strerror}); set LEVIATHAN_CACHE to a "
                f"folder you can write to, {skip}")
    return f"{' '.join(str(error).split())}; {skip}"


def compiler_command():
    return shlex.split(os.environ.get("CC") or shutil.which("cc") or "gcc")  # CC: "ccache gcc"


def build_c_library():
    """Compile C_SOURCE, with OpenMP if the compiler has it, unless this machine's build is cached
    -> the path of the shared library."""
    compiler = compiler_command()
    source = C_SOURCE.read_bytes()
    build_inputs = [source, " ".join(C_FLAGS).encode(), " ".join(compiler).encode(),
                    platform.node().encode(), platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(build_inputs))
    cache = Path(os.environ.get("LEVIATHAN_CACHE") or Path.home() / ".cache" / "leviathan")
    library = cache / f"lev_kernels-{key.hexdigest()[:16]}.so"
    if not library.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # built aside, then renamed: never half a file
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / library.name
            for openmp in (["-fopenmp"], []):
                command = [*compiler, *C_FLAGS, *openmp, str(C_SOURCE), "-o", str(built), "-lm"]
                result = subprocess.run(command, capture_output=True, text=True, timeout=300)
                if result.returncode == 0:
                    break
            if result.returncode != 0:
                raise subprocess.CalledProcessError(result.returncode, command, result.stdout,
                                                    result.stderr)
            os.replace(built, library)
    return library


def load_c_library(path):
    library = ctypes.CDLL(str(path))
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    for name in C_TYPES.values():
        getattr(library, f"lev_forward_{name}").argtypes = [ptr] * 3 + [i64] * 5 + [c_int] * 2
        getattr(library, f"lev_backward_{name}").argtypes = [ptr] * 5 + [i64] * 5 + [c_int] * 2
    return library


def c_spline_product(t, S_padded, normalize):
    """SplineProduct's forward in C: t (U, h, d), S_padded (h*d, kappa + 2, r) -> M (U, h, r)."""
    t, S_padded = check_c_operands(t, S_padded)
    M = t.new_empty(*t.shape[:2], S_padded.shape[2])
    run_c("forward", (t, S_padded, M), normalize)
    return M


def c_spline_product_backward(t, S_padded, G, normalize):
    """SplineProduct's backward in C, from G = dL/dM * M (U, h, r) -> dL/dt (U, h, d),
    dL/dS_padded."""
    t, S_padded, G = check_c_operands(t, S_padded, G)
    grad_t, grad_S = torch.empty_like(t), torch.zeros_like(S_padded)
    run_c("backward", (t, S_padded, G, grad_t, grad_S), normalize)
    return grad_t, grad_S


def run_c(direction, tensors, normalize):
    """lev_<direction>_<f32|f64>(the tensors' data, U, H, D, K, R, normalize, threads)."""
    (U, h, d), (n_padded, r) = tensors[0].shape, tensors[1].shape[1:]
    kernel = getattr(c_library(), f"lev_{direction}_{C_TYPES[tensors[0].dtype]}")
    kernel(*(x.data_ptr() for x in tensors), U, h, d, n_padded - 2, r, normalize,
           torch.get_num_threads())


def check_c_operands(t, S_padded, *others):
    """The C kernels read raw memory: every operand on the CPU, in t's dtype (fp32 or fp64), in the
    shapes of SplineProduct -> the operands, contiguous. (A t outside [0, 1], NaN included, reads
    nothing outside S: the kernels clamp its knot index.)"""
    h, d = t.shape[1:]
    operands = (t, S_padded, *others)
    if not (t.dtype in C_TYPES
            and all(x.device.type == "cpu" and x.dtype == t.dtype for x in operands)
            and S_padded.dim() == 3 and S_padded.shape[0] == h * d and S_padded.shape[1] >= 3
            and all(x.shape == (len(t), h, S_padded.shape[2]) for x in others)):
        shapes = [tuple(x.shape) for x in operands]
        raise ValueError(f"LEV's C kernels: operands of shapes {shapes}, dtypes "
                         f"{[x.dtype for x in operands]}; expected (U, h, d), "
                         f"(h*d, kappa+2, r) and (U, h, r), all fp32 or all fp64 on the CPU")
    return [x.contiguous() for x in operands]
