"""Compile hydragen's C++ CPU ops on first use and cache the build on disk.

The ops (``torch.ops.hydragen.step_attention``, the sampling ops ``sample_truncated`` and ``sample_step``,
speculative decoding's ``ngram_propose`` and the quantized-matmul ops of ``native/quant.py``) are built into
one library with ``-march=native`` for the machine they run on, so they ship as source (``native/csrc/``)
and are compiled by ``torch.utils.cpp_extension`` the first time one is needed. The build lives under
``$HYDRAGEN_CACHE_DIR`` (else ``$HYDRAGEN_CACHE``, else ``~/.cache/hydragen``) in a folder keyed by a hash
of the sources, the torch version, the flags and the CPU, so an edit, an upgrade or a different machine
sharing the home directory never loads a stale or foreign binary. When no compiler works the ops are
reported unavailable with the reason, and callers fall back to their pure-torch twins.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shlex
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

_CSRC = Path(__file__).with_name("csrc")
_SOURCE_NAMES = (
    "step_attention.cpp",
    "sampling.cpp",
    "quant_pack.cpp",
    "quant_matmul.cpp",
    "quant_layers.cpp",  # every layer in one region, through quant_linear.h and step_attention.h
    "ngram.cpp",  # speculative decoding's prompt-lookup drafts
)
SOURCES = tuple(_CSRC / name for name in _SOURCE_NAMES)
HEADERS = tuple(sorted(_CSRC.glob("*.h")))  # included by the sources: copied beside them and part of the key
# -ffp-contract=off: every a * b + c in the sources rounds twice, as written, and only explicit FMAs (ATen's
# fmadd, the intrinsics) fuse. GCC's default for C++ fuses a product into a following add where its inliner
# and the -march=native tuning happen to put both in one basic block, and that differs between template
# instantiations and between CPUs: tuned for Sapphire Rapids, attend<float, float> fused the running sum
# `l * alpha + sum` and attend<float, Half> did not, so a 16-bit cache no longer read as its float32
# widening (tests/unit/attention/test_step_attention.py). What it costs: docs/performance.md.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fvisibility=hidden")
LDFLAGS = ("-fopenmp",)  # tuples: torch's loader appends to the lists it is given
EXTRA_FLAGS_ENV = "HYDRAGEN_CPP_FLAGS"  # more compiler flags, after CFLAGS (part of the build key)

_lock = threading.Lock()
_ops: object | None = None  # the torch.ops.hydragen namespace once loaded
_error: str | None = None


CACHE_ENV = "HYDRAGEN_CACHE_DIR"  # hydragen's cache folder; HYDRAGEN_CACHE is its older name


def cache_dir() -> Path:
    """The folder of every hydragen cache: compiled ops, converted tokenizers, random-weights files."""
    root = os.environ.get(CACHE_ENV) or os.environ.get("HYDRAGEN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "hydragen"


def _cpu_identity() -> str:
    """The CPU model and feature flags: a -march=native binary is only valid where they match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))  # every core repeats them: keep one copy


def cflags() -> tuple[str, ...]:
    """CFLAGS, then the flags in ``$HYDRAGEN_CPP_FLAGS`` (split as a shell splits them). The vector width of
    the ops is fixed at compile time, so ``HYDRAGEN_CPP_FLAGS=-mno-avx512f`` is how an AVX-512 machine builds
    and tests the AVX2 branches (``-mno-avx2 -mno-avx512f``: the portable ones)."""
    return CFLAGS + tuple(shlex.split(os.environ.get(EXTRA_FLAGS_ENV, "")))


def build_key() -> str:
    parts = [source.read_bytes() for source in SOURCES + HEADERS]
    parts += [torch.__version__.encode(), " ".join(cflags() + LDFLAGS).encode()]
    parts.append(_cpu_identity().encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


@contextlib.contextmanager
def _build_lock(where: Path):
    """One build at a time per folder, across processes. torch's own lock is a file that a killed build
    leaves behind, after which every later load would wait forever; ours is an OS lock, released when its
    holder dies, so a torch lock file found while we hold ours is stale and is removed. The holder writes its
    process id into the lock file; a process that must wait while the holder compiles (a minute or more)
    says on stderr, once, whom and which lock it waits for."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's lock alone
        yield
        return
    lock = where / "hydragen.lock"
    with open(lock, "a+") as handle:  # "a+": opening it must not erase the holder's process id
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not (where / f"{where.name}.so").exists():  # the holder is compiling, not loading a library
                _say_waiting(handle, lock)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        (where / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            handle.truncate(0)  # the id names the holder only while it holds the lock
            fcntl.flock(handle, fcntl.LOCK_UN)


def _say_waiting(handle, lock: Path) -> None:
    handle.seek(0)
    holder = handle.read().strip()
    who = f"process {holder}" if holder.isdigit() else "another process"  # empty until the holder writes it
    print(
        f"hydragen: waiting for {who} to finish compiling the C++ CPU ops (build lock {lock})",
        file=sys.stderr,
        flush=True,
    )


def library_name() -> str:
    return f"hydragen_ops_{build_key()}"


def build_folder() -> Path:
    return cache_dir() / "ext" / library_name()


def _build() -> object:
    """Load the library, building it first when this machine has none of these sources; the op namespace."""
    from torch.utils import cpp_extension

    name = library_name()
    where = cache_dir() / "ext" / name  # build_folder(), without hashing the sources a second time
    where.mkdir(parents=True, exist_ok=True)
    with _build_lock(where):
        library = where / f"{name}.so"
        if library.exists():  # built before, by any checkout: the key names its source exactly
            torch.ops.load_library(str(library))
            return torch.ops.hydragen
        # Built from copies inside the folder: build.ninja then never names a checkout, so two checkouts of
        # one version share one build instead of rebuilding it for each other.
        copies = [where / source.name for source in SOURCES]
        for source in SOURCES + HEADERS:
            (where / source.name).write_bytes(source.read_bytes())
        start = time.perf_counter()
        cpp_extension.load(
            name=name,
            sources=[str(copy) for copy in copies],
            extra_cflags=list(cflags()),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(where),
            is_python_module=False,
            verbose=False,
        )
    print(
        f"hydragen: compiled the C++ CPU ops in {time.perf_counter() - start:.1f} s (cached in {where})",
        file=sys.stderr,
    )
    return torch.ops.hydragen


def disabled_reason() -> str | None:
    """Why the C++ op must not be used in this process (None: it may be built)."""
    if os.environ.get("HYDRAGEN_NO_CPP", "") not in ("", "0"):
        return "disabled by HYDRAGEN_NO_CPP"
    return None


def load_ops() -> object | None:
    """The compiled ops' namespace, building it on first call; None when disabled or unbuildable
    (see ``build_error``)."""
    global _ops, _error
    if disabled_reason() is not None:
        return None
    if _ops is None and _error is None:
        with _lock:
            if _ops is None and _error is None:
                try:
                    _ops = _build()
                except Exception as exc:  # no compiler, no ninja, a compile error: all mean "use torch"
                    lines = str(exc).strip().splitlines()
                    _error = f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"
    return _ops


def step_attention_op() -> Callable | None:
    """``torch.ops.hydragen.step_attention``, or None when the ops are unavailable."""
    ops = load_ops()
    return None if ops is None else ops.step_attention


def sample_truncated_op() -> Callable | None:
    """``torch.ops.hydragen.sample_truncated``, or None when the ops are unavailable."""
    ops = load_ops()
    return None if ops is None else ops.sample_truncated


def sample_step_op() -> Callable | None:
    """``torch.ops.hydragen.sample_step``, or None when the ops are unavailable."""
    ops = load_ops()
    return None if ops is None else ops.sample_step


def ngram_propose_op() -> Callable | None:
    """``torch.ops.hydragen.ngram_propose``, or None when the ops are unavailable."""
    ops = load_ops()
    return None if ops is None else ops.ngram_propose


def vec_capability() -> str | None:
    """The vector width the ops were compiled for, in ``torch.backends.cpu.get_cpu_capability()``'s words
    ("AVX512", "AVX2" or "DEFAULT"); None when the ops are unavailable."""
    ops = load_ops()
    return None if ops is None else str(ops.vec_capability())


def build_error() -> str | None:
    """Why the op is unavailable: disabled, or the build's error; None when it built (or was never tried)."""
    return disabled_reason() or _error
