"""CUDA C++ kernels compiled at run time and launched on torch's stream, through ctypes alone.

Owns: finding a compiler (NVRTC, which torch's CUDA wheels ship as ``nvidia-cuda-nvrtc``, else ``nvcc``),
compiling a source file with ``-D`` defines to a cubin for the device's architecture (cached on disk by a
hash of the source, the defines and the architecture), loading it with the CUDA driver API and launching a
kernel that takes one parameter struct. A launch goes on the current torch stream, so it is captured into
CUDA graphs like any other kernel. Nothing here reads device memory.

It must not know any kernel's meaning (``kernels/decode_megakernel.py`` owns its one user). The project's
kernels are Triton; this exists for the one whose design Triton cannot express (see that module).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CudaCompileError(RuntimeError):
    """A CUDA C++ source did not compile (the message holds the compiler's log), or no compiler exists."""


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed."""


def cache_dir() -> Path:
    """Where compiled cubins are kept: ``$PDMESH_CUDA_CACHE``, else ``~/.cache/pdmesh/cuda``."""
    return Path(os.environ.get("PDMESH_CUDA_CACHE") or Path.home() / ".cache" / "pdmesh" / "cuda")


# ---- compilers ------------------------------------------------------------------------------------------
def _nvrtc_candidates() -> list[str]:
    names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    roots = [Path(p) for p in sys.path if p] + [Path(torch.__file__).parent.parent]
    found: list[str] = []
    for root in roots:
        for pattern in ("nvidia/*/lib/libnvrtc.so*", "nvidia/cu*/lib/libnvrtc.so*"):
            found += sorted(glob.glob(str(root / pattern)))
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    return names + [f for f in found if "builtins" not in f and "alt" not in f]


def _load_nvrtc() -> ctypes.CDLL | None:
    for name in _nvrtc_candidates():
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    return None


def find_nvcc() -> str | None:
    """An ``nvcc`` on PATH or under ``$CUDA_HOME/bin``, or None."""
    found = shutil.which("nvcc")
    if found:
        return found
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    path = os.path.join(cuda_home, "bin", "nvcc")
    return path if os.path.exists(path) else None


def _compile_nvrtc(lib: ctypes.CDLL, source: str, name: str, options: list[str]) -> bytes:
    prog = ctypes.c_void_p()

    def check(code: int, what: str) -> None:
        if code != 0:
            raise CudaCompileError(f"{what}: {lib.nvrtcGetErrorString(code).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
          "nvrtcCreateProgram")  # fmt: skip
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        code = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        if code != 0:
            raise CudaCompileError(f"{name} did not compile (NVRTC):\n{buf.value.decode(errors='replace')}")
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _compile_nvcc(nvcc: str, path: Path, arch: str, defines: dict[str, int | float]) -> tuple[bytes, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "k.cubin"
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-O3", "-Xptxas", "-v", "-o", str(out)]
        cmd += [f"-D{k}={v}" for k, v in defines.items()] + [str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CudaCompileError(f"{path.name} did not compile (nvcc):\n{proc.stderr}")
        return out.read_bytes(), proc.stderr


@dataclass(frozen=True)
class CompiledKernel:
    cubin: bytes
    arch: str
    compiler: str  # "nvrtc", "nvcc", or "cache" (read from cache_dir())
    log: str = ""  # nvcc's resource report (registers, spills) where nvcc compiled it


def compile_cuda(
    path: Path, defines: dict[str, int | float], arch: str, use_cache: bool = True
) -> CompiledKernel:
    """``path`` compiled with ``defines`` for ``arch`` (e.g. "sm_90") to a cubin: NVRTC where its library
    loads, else nvcc; cached under ``cache_dir()``. Raises ``CudaCompileError`` with the compiler's log."""
    source = path.read_text()
    key = hashlib.sha256(
        (source + repr(sorted(defines.items())) + arch + str(torch.version.cuda)).encode()
    ).hexdigest()[:24]
    cached = cache_dir() / f"{path.stem}-{arch}-{key}.cubin"
    if use_cache and cached.exists():
        return CompiledKernel(cached.read_bytes(), arch, "cache")
    lib = _load_nvrtc()
    if lib is not None:
        options = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device"]
        options += [f"-D{k}={v}" for k, v in defines.items()]
        compiled = CompiledKernel(_compile_nvrtc(lib, source, path.name, options), arch, "nvrtc")
    else:
        nvcc = find_nvcc()
        if nvcc is None:
            raise CudaCompileError(
                "no CUDA compiler: neither libnvrtc (torch's CUDA wheels bring it as nvidia-cuda-nvrtc) nor "
                "nvcc was found"
            )
        cubin, report = _compile_nvcc(nvcc, path, arch, defines)
        compiled = CompiledKernel(cubin, arch, "nvcc", report)
    if use_cache:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(compiled.cubin)
            tmp.replace(cached)
        except OSError as exc:  # a read-only home: compile again next time
            log.warning("could not cache %s: %s", cached, exc)
    return compiled


# ---- the driver ---------------------------------------------------------------------------------------
_driver_lock = threading.Lock()
_driver: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaDriverError(f"the CUDA driver library (libcuda.so.1) did not load: {exc}") from exc
            vp, u = ctypes.c_void_p, ctypes.c_uint
            lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
            lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), vp]
            lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
            lib.cuFuncSetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_int]
            lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, vp]
            _driver = lib
        return _driver


def _check(code: int, what: str) -> None:
    if code != 0:
        msg = ctypes.c_char_p()
        _cuda().cuGetErrorString(code, ctypes.byref(msg))
        raise CudaDriverError(f"{what} failed: {msg.value.decode() if msg.value else code}")


class CudaKernel:
    """One kernel of a loaded cubin, in the primary context of ``device`` (torch's), launched with a
    single by-value parameter (a packed struct) on the current torch stream."""

    def __init__(self, compiled: CompiledKernel, name: str, device: torch.device, dynamic_smem: int) -> None:
        self.device = device
        self.dynamic_smem = dynamic_smem
        self.name = name
        drv = _cuda()
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()  # the primary context is current here
            self._module = ctypes.c_void_p()
            self._image = ctypes.create_string_buffer(compiled.cubin, len(compiled.cubin))
            _check(drv.cuModuleLoadData(ctypes.byref(self._module), ctypes.cast(self._image, ctypes.c_void_p)),
                   "cuModuleLoadData")  # fmt: skip
            self._func = ctypes.c_void_p()
            _check(drv.cuModuleGetFunction(ctypes.byref(self._func), self._module, name.encode()),
                   f"cuModuleGetFunction({name})")  # fmt: skip
            if dynamic_smem > 48 * 1024:
                _check(drv.cuFuncSetAttribute(self._func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                              dynamic_smem), "cuFuncSetAttribute")  # fmt: skip
        self.num_regs = self._attribute(4)  # CU_FUNC_ATTRIBUTE_NUM_REGS
        self.local_bytes = self._attribute(3)  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES (spills)

    def _attribute(self, attr: int) -> int:
        value = ctypes.c_int()
        _check(_cuda().cuFuncGetAttribute(ctypes.byref(value), attr, self._func), "cuFuncGetAttribute")
        return value.value

    def launch(self, grid: int, block: int, params: bytes) -> None:
        """Launch on the current stream of the kernel's device (graph-capturable)."""
        buf = ctypes.create_string_buffer(params, len(params))
        args = (ctypes.c_void_p * 1)(ctypes.cast(buf, ctypes.c_void_p))
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        _check(
            _cuda().cuLaunchKernel(
                self._func,
                grid,
                1,
                1,
                block,
                1,
                1,
                self.dynamic_smem,
                stream,
                ctypes.cast(args, ctypes.c_void_p),
                None,
            ),
            f"cuLaunchKernel({self.name})",
        )
