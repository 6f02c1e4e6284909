"""vendor.cpu_native: kernels written for the CPU (csrc/*.cpp), built on first use with this machine's C++
compiler against the installed torch, and cached.

The build is one ``c++`` call (no ninja, no Python headers): ``-O3 -march=native -fopenmp``, torch's include and
library directories, its C++ ABI. The library registers ``torch.ops.turnout_cpu.*`` and runs its loops on torch's
own intra-op threads (``at::parallel_for``; ``-fopenmp`` links ``libgomp.so.1``, which resolves to the one torch
already loaded). It lands in ``$TURNOUT_NATIVE_CACHE`` (default ``$XDG_CACHE_HOME/turnout/native`` or
``~/.cache/turnout/native``) under a key of the source, the torch version, the flags and this CPU's feature flags,
so another torch or another machine builds its own. Built into a temporary file and renamed: processes that build
at the same time each finish with a whole library.

Where no compiler is found, or the build fails, the implementations here are unavailable with that reason (the
policy then takes ``vendor.cpu``); nothing is retried within the process.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time

import torch

from turnout import envs
from turnout.ops.spec import ImplUnavailable
from turnout.ops.w4_layout import check_layout

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "w4a16.cpp")


def _cache_dir(settings) -> str:
    if settings.native_cache is not None:
        return str(settings.native_cache)
    base = str(settings.xdg_cache_home or os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(base, "turnout", "native")


def _arch_flags() -> list[str]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        return ["-march=native"]
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _command(compiler: str, source: str, out: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    cmd = [compiler, "-O3", *_arch_flags(), "-fopenmp", "-shared", "-fPIC", "-std=c++20",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}", "-w"]
    for inc in include_paths():
        cmd += ["-isystem", inc]
    cmd += [source, "-o", out]
    for lib in library_paths():
        cmd += [f"-L{lib}"]
    return cmd + ["-lc10", "-ltorch_cpu"]


@functools.cache
def load() -> str:
    """Build (once per machine and torch) and load the library, once per process; its path. ImplUnavailable
    with the reason."""
    return build(envs.get())


def build(settings) -> str:
    """``load`` under ``settings`` (``turnout.envs.Envs``: the compiler, the cache directory)."""
    compiler = settings.cxx or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise ImplUnavailable("no C++ compiler (c++, g++ or clang++ on PATH, or $CXX) to build the CPU kernels")
    key = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        key.update(f.read())
    key.update(" ".join(_command("c++", "SRC", "OUT")[1:]).encode())
    key.update(f"{torch.__version__}|{platform.machine()}|{_cpu_features()}".encode())
    directory = os.path.join(_cache_dir(settings), key.hexdigest()[:16])
    lib = os.path.join(directory, "turnout_cpu_native.so")
    if not os.path.exists(lib):
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        logger.info("building turnout's CPU kernels with %s (once for this machine and torch; ~10-20 s)", compiler)
        t0 = time.perf_counter()
        try:
            done = subprocess.run(_command(compiler, SOURCE, tmp), capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            os.unlink(tmp)
            raise ImplUnavailable(f"building the CPU kernels with {compiler} failed: {e}") from e
        if done.returncode != 0:
            os.unlink(tmp)
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise ImplUnavailable(f"building the CPU kernels with {compiler} failed (exit {done.returncode}): "
                                  f"{tail[:400]}")
        os.replace(tmp, lib)
        logger.info("built %s in %.1f s", lib, time.perf_counter() - t0)
    try:
        torch.ops.load_library(lib)
    except Exception as e:  # a library from an incompatible build: say so, do not guess
        raise ImplUnavailable(f"loading {lib} failed: {e}") from e
    return lib


def w4a16_linear_factory():
    """The w4a16_linear implementation, once the library is loaded (ImplUnavailable otherwise)."""
    load()
    mm = torch.ops.turnout_cpu.w4a16_mm

    def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scale_zeros: torch.Tensor, group_size: int,
                     act_perm: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """See turnout/ops/reference/w4a16.py; float32 arithmetic whatever x's dtype, y in x's dtype."""
        if x.dim() != 2:
            raise ValueError(f"w4a16_linear takes x [M, K], got {tuple(x.shape)}")
        check_layout(x.shape[1], qweight, scale_zeros, group_size, act_perm)
        xf = x.float() if act_perm is None else x.float().index_select(1, act_perm)
        y = mm(xf.contiguous(), qweight, scale_zeros.contiguous(), group_size)
        if bias is not None:
            y += bias.float()
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    return w4a16_linear


def moe_experts_w4a16_factory():
    """moe_experts_w4a16 with each active expert's projections through the native w4a16_linear."""
    from turnout.ops.vendors.cpu.moe_w4a16 import experts_over

    return experts_over(w4a16_linear_factory())
