"""Small C kernels for the CPU: built once with the system C compiler, cached, loaded with ctypes.

The CPU path's hand-written kernels (``attention_cpu``'s decode attention, ``elementwise_cpu``'s
norms and rotary) are C sources in Python strings. ``build`` compiles one with ``-O3
-march=native`` (about half a second), with OpenMP where the compiler has it, into
``cache_root()/kernels`` under a name keyed by the source, the compiler, the flags and the CPU's
feature flags (code built for one CPU is never loaded on another sharing the folder), and returns
the library's path; ``None`` when there is no compiler or the build fails (logged), so callers
fall back to torch. Every use touches the library's modification time, and the first build call of
a process removes the folder's libraries unused for ``STALE_AFTER_DAYS`` (left by older versions of
the sources, other compilers or other CPUs), so the folder does not grow with every upgrade. A
``ctypes`` call releases the GIL; the OpenMP runtime is the ``libgomp`` torch already loaded, so the
kernels share torch's thread pool and thread count.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("asyncllm")

__all__ = [
    "F32",
    "I32",
    "I64",
    "PTR",
    "STALE_AFTER_DAYS",
    "VECTOR_HELPERS",
    "Signatures",
    "address",
    "build",
    "compiler",
    "cpu_flags",
    "cpu_vendor",
    "declare",
    "load",
    "torch_cpu_library",
]

STALE_AFTER_DAYS = 30
"""A built library not used for this many days is removed from the cache (rebuilt if ever needed)."""

BASE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")

# What every kernel source starts with, after its includes (<stdint.h>, <string.h>) and its ``#define W``:
# vectors of W floats in GCC/clang vector extensions (AVX-512, AVX2 or NEON, whatever -march=native has).
VECTOR_HELPERS = r"""
typedef float vec __attribute__((vector_size(W * 4)));
typedef int32_t ivec __attribute__((vector_size(W * 4)));

static inline vec load(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }
static inline vec splat(float x) { return (vec){0} + x; }

/* The sum of the lanes by a tree of halvings (lane j plus lane j + w, for w = W / 2 down to 1), not a
   lane-by-lane chain: without -ffast-math the compiler keeps the written order, and sixteen dependent adds
   per dot product would make a kernel compute-bound. Written as whole-vector shuffles where the compiler has
   them (GCC 12, clang): lane indexing compiles to a store and a chain of scalar reloads, which cost the decode
   attention a quarter of its time. */
#if defined(__clang__) || __GNUC__ >= 12
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));
typedef float vec2 __attribute__((vector_size(8)));
static inline float hsum(vec v) {
#if W == 16
    const vec8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
        + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#elif W == 8
    const vec8 v8 = v;
#endif
#if W >= 8
    const vec4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) + __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
#else
    const vec4 v4 = v;
#endif
    const vec2 v2 = __builtin_shufflevector(v4, v4, 0, 1) + __builtin_shufflevector(v4, v4, 2, 3);
    return v2[0] + v2[1];
}
#else
static inline float hsum(vec v) {
    for (int w = W / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) v[j] += v[j + w];
    return v[0];
}
#endif
"""


PTR, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
"""The ctypes types of the kernels' C signatures: a pointer, ``int``, ``int64_t``, ``float``."""

Signatures = Mapping[str, tuple[Sequence[Any], Any]]
"""C signatures by function name: (argument types, result type, None for void)."""


def address(function: Any) -> int:
    """A loaded library function's address, for C code that calls it through a pointer."""
    value = ctypes.cast(function, ctypes.c_void_p).value
    assert value is not None
    return value


def declare(library: ctypes.CDLL, signatures: Signatures) -> ctypes.CDLL:
    """Give ``library``'s functions their C signatures and return it.

    ctypes converts every argument by them (a Python int to a 64-bit integer, not a C ``int``),
    and reads the result as declared.

    Raises:
        AttributeError: The library has no function of one of the names.
    """
    for name, (arguments, result) in signatures.items():
        function = getattr(library, name)
        function.argtypes = list(arguments)
        function.restype = result
    return library


def load(name: str, source: str, signatures: Signatures, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """``build`` ``source`` and load the library with its functions declared (``declare``).

    Returns:
        The library, or None when no compiler is found or the build fails (logged).
    """
    path = build(name, source, flags)
    return None if path is None else declare(ctypes.CDLL(str(path)), signatures)


@functools.cache
def torch_cpu_library() -> ctypes.CDLL | None:
    """torch's ``libtorch_cpu.so`` (already loaded by ``import torch``), for symbols it exports that
    torch has no Python entry for: MKL's packed GEMM (``models._linear``), SLEEF's vector exp
    (``backends.cpu._activation``). None where the file is missing or cannot be loaded."""
    import torch  # here, not at the top: the kernel builder itself does not need torch

    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not path.exists():
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError:
        return None


def compiler() -> str | None:
    """The C compiler to use: ``$CC``, else the first of cc, gcc, clang on the PATH; None if none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _cpu_flags_line() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (``avx512f``, ``asimd``, ...); empty elsewhere."""
    _, _, flags = _cpu_flags_line().partition(":")
    return frozenset(flags.split())


def cpu_vendor() -> str:
    """The CPU's vendor as Linux's ``/proc/cpuinfo`` names it (``GenuineIntel``, ``AuthenticAMD``); "" elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            line = next((line for line in info if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def _cpu_signature() -> str:
    # -march=native code must not be reused on another CPU sharing the same cache folder.
    return f"{platform.machine()} {platform.processor()} {_cpu_flags_line()}"


def build(name: str, source: str, flags: tuple[str, ...] = ()) -> Path | None:
    """Compile ``source`` into a shared library (once; cached) and return its path.

    Args:
        name: A file-name stem for the library (the cache key is appended).
        source: The complete C source.
        flags: Flags beyond ``BASE_FLAGS`` (``-fopenmp`` is added, and dropped if the compiler
            lacks OpenMP: the kernels are then single-threaded).

    Returns:
        The library's path, or None when no compiler is found or the build fails (logged).
    """
    from asyncllm.default_model import cache_root
    cc = compiler()
    if cc is None:
        logger.info("no C compiler found (cc, gcc, clang or $CC): the %s kernels are unavailable", name)
        return None
    folder = cache_root() / "kernels"
    _remove_stale(folder)
    for openmp in (("-fopenmp",), ()):
        all_flags = (*BASE_FLAGS, *flags, *openmp)
        key = hashlib.sha256("\0".join((source, cc, *all_flags, _cpu_signature())).encode()).hexdigest()[:20]
        path = folder / f"{name}_{key}.so"
        if path.exists():
            _touch(path)
            return path
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as scratch:
                source_path = Path(scratch) / f"{name}.c"
                source_path.write_text(source, encoding="utf-8")
                built = Path(scratch) / path.name
                command = [cc, *all_flags, str(source_path), "-o", str(built), "-lm"]
                subprocess.run(command, check=True, capture_output=True, timeout=120)
                os.replace(built, path)  # atomic: a concurrent builder's file is as good as ours
            return path
        except (OSError, subprocess.SubprocessError) as exc:
            stderr = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else None
            detail = stderr.decode(errors="replace")[-400:] if isinstance(stderr, bytes) else ""
            logger.debug("building the %s kernels with %s %s failed: %s %s", name, cc, all_flags, exc, detail)
    logger.warning("building the %s kernels failed (%s): they are unavailable", name, cc)
    return None


def _touch(path: Path) -> None:
    # A library's modification time is its last use: what _remove_stale goes by.
    with contextlib.suppress(OSError):  # a read-only shared cache: the library is used, just not marked
        os.utime(path)


@functools.cache
def _remove_stale(folder: Path) -> None:
    """Remove the libraries in ``folder`` unused for ``STALE_AFTER_DAYS`` (once per process and folder).

    A process that loaded one of them keeps its mapping; one that finds a library gone rebuilds it.
    """
    cutoff = time.time() - STALE_AFTER_DAYS * 86400
    try:
        libraries = list(folder.glob("*.so"))
    except OSError:
        return
    for library in libraries:
        try:
            if library.stat().st_mtime < cutoff:
                library.unlink()
                logger.debug("removed the unused kernel library %s", library)
        except OSError:
            continue  # gone already, or not ours to remove

