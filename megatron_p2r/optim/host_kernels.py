"""The host optimizer kernels (``host_kernels.cpp``): AdamW, Lion and factored Adafactor on flat
CPU shards in as few passes over memory as their arithmetic needs (``optim/traffic.py`` counts
them), on ``threads()`` threads whatever OMP_NUM_THREADS says.

Why C++ and not torch.compile: measured on this project's 2-core host, the compiled C++ kernels
(a plain shared library loaded with ctypes, no torch headers) build in about 2 s once per
machine and reach the memory bound; inductor's CPU code needs the same compiler, tens of seconds
per kernel and dtype setting on first use, and a recompile per shape (docs/host_optimizer.md).

The library is compiled on first use with ``$CXX`` (default g++) and cached under
``$XDG_CACHE_HOME/megatron_p2r`` (default ~/.cache), keyed by the source, the flags and the
CPU; nothing is compiled at import. Without a compiler ``available()`` is False and the
optimizers step with their torch reference arithmetic (same results, several times slower),
after one warning. The calls release the GIL, so the overlapped host step's workers run them
while Python runs the model.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

SOURCE = Path(__file__).with_name("host_kernels.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-pthread")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_state = {"threads": 1, "library": None, "tried": False}
# Called with (kernel name, tensors read, tensors written) before each kernel call (tests count traffic).
traffic_hook: Optional[Callable[[str, Sequence[torch.Tensor], Sequence[torch.Tensor]], None]] = None


def set_threads(threads: int) -> None:
    """The threads each kernel call splits its shard over (``--host-optimizer-threads``)."""
    _state["threads"] = max(1, int(threads))


def threads() -> int:
    return _state["threads"]


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_p2r"


def _build(compiler: str) -> Path:
    """The cached library for this source, compiler, flags and CPU, compiled when missing (written
    to a temporary name and renamed, so concurrent ranks never load a half-written file). The
    compiler reads the very text the key was made of (a copy), so a source edited meanwhile
    never lands under the old text's key."""
    text = SOURCE.read_text()
    key = hashlib.sha256("\0".join([text, compiler, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"host_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        source, tmp = Path(work) / SOURCE.name, Path(work) / out.name
        source.write_text(text)
        subprocess.run([compiler, *FLAGS, str(source), "-o", str(tmp)], check=True, capture_output=True, text=True)
        os.replace(tmp, out)
    return out


def library() -> Optional[ctypes.CDLL]:
    """The compiled kernels, or None (warned once) when no compiler can build them."""
    if not _state["tried"]:
        _state["tried"] = True
        compiler = shutil.which(os.environ.get("CXX", "g++"))
        try:
            if compiler is None:
                raise OSError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
            _state["library"] = _declare(ctypes.CDLL(str(_build(compiler))))
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            warnings.warn(
                f"host optimizer kernels unavailable ({detail.strip()[:300]}): the host step uses "
                "torch's reference arithmetic (same results, slower)",
                RuntimeWarning,
                stacklevel=2,
            )
    return _state["library"]


def available() -> bool:
    return library() is not None


def steps(*tensors: torch.Tensor) -> bool:
    """Whether the kernels step these tensors: contiguous CPU tensors, and the library built."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and available()


I64, INT, FLT, PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SIGNATURES = {
    "adamw_step": [I64, PTR, INT, PTR, INT, PTR, INT, PTR, INT, PTR, INT] + [FLT, FLT, FLT, INT] + [FLT] * 5 + [INT],
    "lion_step": [I64, PTR, INT, PTR, INT, PTR, INT, PTR, INT, FLT, INT, FLT, FLT, FLT, INT, FLT, FLT, INT, INT],
    "adafactor_sums": [I64, I64, I64, I64, PTR, INT, PTR, INT, PTR, PTR, PTR, INT],
    "adafactor_update_sums": [I64, I64, I64, I64, PTR, INT, PTR, PTR, PTR, FLT, PTR, INT],
    "adafactor_apply": [I64, I64, I64, I64, PTR, INT, PTR, INT, PTR, INT, PTR, PTR, PTR, FLT, PTR, FLT, PTR, INT],
    "triad": [I64, PTR, PTR, PTR, FLT, INT],
    "peak_threads": [],
}


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, args in SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    lib.peak_threads.restype = ctypes.c_int
    return lib


def _call(name: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], *args) -> None:
    for t in (*reads, *writes):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"host kernel {name}: tensors must be contiguous CPU tensors")
    if traffic_hook is not None:
        traffic_hook(name, reads, writes)
    getattr(library(), name)(*args)


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _code(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else DTYPE_CODES[t.dtype]


def lerp_weight(w: float):
    """torch's scalar lerp weight as its kernel uses it: (w, w - 1, |w| < 0.5) in fp32."""
    w32 = torch.tensor(w, dtype=torch.float32)
    return float(w32), float(w32 - 1), int(abs(float(w32)) < 0.5)


def adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    weight: Optional[torch.Tensor] = None,
) -> None:
    """One AdamW step (``step``: the count after it) of flat tensors, in place, as torch's fused
    kernel computes it in fp32; ``weight``: also written with the new parameter, rounded."""
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    decay = 1 - lr * weight_decay if weight_decay != 0 else 1.0
    w, w1, small = lerp_weight(1 - beta1)
    _call(
        "adamw_step",
        (param, grad, exp_avg, exp_avg_sq),
        (param, exp_avg, exp_avg_sq, *_opt(weight)),
        param.numel(),
        param.data_ptr(),
        _code(param),
        grad.data_ptr(),
        _code(grad),
        exp_avg.data_ptr(),
        _code(exp_avg),
        exp_avg_sq.data_ptr(),
        _code(exp_avg_sq),
        _ptr(weight),
        _code(weight),
        decay,
        w,
        w1,
        small,
        beta2,
        1 - beta2,
        bias_correction2_sqrt,
        eps,
        -(lr / bias_correction1),
        threads(),
    )


def lion(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    weight: Optional[torch.Tensor] = None,
) -> None:
    """One Lion step of flat tensors, in place (``optim/lion.py``'s arithmetic)."""
    _call(
        "lion_step",
        (param, grad, exp_avg),
        (param, exp_avg, *_opt(weight)),
        param.numel(),
        param.data_ptr(),
        _code(param),
        grad.data_ptr(),
        _code(grad),
        exp_avg.data_ptr(),
        _code(exp_avg),
        _ptr(weight),
        _code(weight),
        1 - lr * weight_decay,
        int(weight_decay != 0),
        -lr,
        *lerp_weight(1 - beta1),
        *lerp_weight(1 - beta2),
        threads(),
    )


def _opt(t: Optional[torch.Tensor]) -> tuple:
    return () if t is None else (t,)


def adafactor_sums(
    start: int, rows: int, cols: int, batches: int, grad: torch.Tensor, main: Optional[torch.Tensor]
) -> torch.Tensor:
    """Pass 1 over a piece [start, start + n) of a (batches x rows) x cols weight: its row sums
    of g^2 (batches * rows), column sums (batches * cols) and the main's sum of squares per
    matrix (batches; left zero when ``main`` is None: the last ``adafactor_apply`` returned
    it), laid out as ``Adafactor._sums``."""
    out = torch.zeros(batches * (rows + cols + 1), dtype=torch.float32)
    b, r = batches * rows, batches * (rows + cols)
    _call(
        "adafactor_sums",
        (grad, *_opt(main)),
        (),
        start,
        grad.numel(),
        rows,
        cols,
        grad.data_ptr(),
        _code(grad),
        _ptr(main),
        _code(main),
        out.data_ptr(),
        out[b:].data_ptr(),
        out[r:].data_ptr(),
        threads(),
    )
    return out


def adafactor_update_sums(
    start: int,
    rows: int,
    cols: int,
    batches: int,
    grad: torch.Tensor,
    row_var: torch.Tensor,
    col_var: torch.Tensor,
    mean: torch.Tensor,
    floor: float,
) -> torch.Tensor:
    """Pass 2: each matrix's sum of the update's squares (batches values)."""
    out = torch.zeros(batches, dtype=torch.float32)
    _call(
        "adafactor_update_sums",
        (grad,),
        (),
        start,
        grad.numel(),
        rows,
        cols,
        grad.data_ptr(),
        _code(grad),
        row_var.data_ptr(),
        col_var.data_ptr(),
        mean.data_ptr(),
        floor,
        out.data_ptr(),
        threads(),
    )
    return out


def adafactor_apply(
    start: int,
    rows: int,
    cols: int,
    grad: torch.Tensor,
    main: torch.Tensor,
    row_var: torch.Tensor,
    col_var: torch.Tensor,
    mean: torch.Tensor,
    floor: float,
    scale: torch.Tensor,
    decay: float,
    weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pass 3: main = main * decay - update * scale[matrix] (``weight`` as in ``adamw``); returns
    the new main's sum of squares per matrix, as the next pass 1 would add it up."""
    weight_sq = torch.zeros(scale.numel(), dtype=torch.float32)
    _call(
        "adafactor_apply",
        (grad, main),
        (main, *_opt(weight)),
        start,
        grad.numel(),
        rows,
        cols,
        grad.data_ptr(),
        _code(grad),
        main.data_ptr(),
        _code(main),
        _ptr(weight),
        _code(weight),
        row_var.data_ptr(),
        col_var.data_ptr(),
        mean.data_ptr(),
        floor,
        scale.data_ptr(),
        decay,
        weight_sq.data_ptr(),
        threads(),
    )
    return weight_sq


def peak_threads() -> int:
    """The most threads any kernel call made on the calling thread ran on since the last call of
    this (0: none ran): what the rank's host step really used, against the planner's threads."""
    return library().peak_threads()


def triad(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, s: float) -> None:
    """a = b + s * c over fp32 tensors (STREAM's triad: the benchmark's memory bound)."""
    _call("triad", (b, c), (a,), a.numel(), a.data_ptr(), b.data_ptr(), c.data_ptr(), s, threads())
