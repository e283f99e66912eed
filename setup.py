"""Build of the optional native kernels (``libratio_jax.physics._native``, XLA FFI handlers for
the CPU; see ``src/libratio_jax/physics/native.py``). Everything else is in pyproject.toml.

The extension needs a C++17 compiler and the XLA FFI headers that jaxlib ships (a build
requirement). It is optional: where it cannot be built the package installs without it and
runs the same computations in XLA (``libratio_jax.physics.native.status()`` says which).
``LIBRATIO_NO_NATIVE=1`` in the environment skips it.

Beside it, where CUDA's compiler ``nvcc`` is on the PATH and an NVIDIA driver is present
(``libcuda.so.1`` loads), or ``LIBRATIO_BUILD_CUDA=1`` asks for it, the CUDA kernel
``libratio_jax/physics/_cuda_kernels.so`` (an XLA FFI handler for NVIDIA GPUs of compute
capability 8.0 or later; ``physics/cuda_kernels.py``). Also optional: a failed build prints
why and the package installs without it (the Pallas kernel runs instead).
"""

import ctypes
import os
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CUDA_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", "libratio_jax",
                           "physics", "_cuda_kernels.cu")
# sm_80 (A100) and sm_90 (H100, H200) machine code, and PTX for later GPUs to compile
CUDA_TARGETS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode",
                "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]


def _ffi_include_dir():
    """jaxlib's include directory (``jax.ffi.include_dir()``), or None without jaxlib."""
    try:
        import jaxlib
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    return path if os.path.exists(os.path.join(path, "xla", "ffi", "api", "ffi.h")) else None


include = _ffi_include_dir()
extensions = [] if include is None or os.environ.get("LIBRATIO_NO_NATIVE") else [Extension(
    "libratio_jax.physics._native",
    sources=["src/libratio_jax/physics/_native.cc"],
    include_dirs=[include],
    language="c++",
    extra_compile_args=["-std=c++17", "-O3", "-fvisibility=hidden", "-Wno-attributes"],
    optional=True,
)]


def _wants_cuda() -> bool:
    if (os.environ.get("LIBRATIO_NO_NATIVE") or include is None or not shutil.which("nvcc")
            or not os.path.exists(CUDA_SOURCE)):
        return False
    if os.environ.get("LIBRATIO_BUILD_CUDA", "").strip() == "1":
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


class BuildWithCuda(build_ext):
    """The C++ extensions, then the CUDA kernel's shared library beside them (no Python
    module: ``cuda_kernels.py`` loads it with ctypes)."""

    def run(self):
        super().run()
        if not _wants_cuda():
            return
        out = os.path.join(os.path.dirname(self.get_ext_fullpath("libratio_jax.physics._native")),
                           "_cuda_kernels.so")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cmd = ["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
               f"-I{include}", *CUDA_TARGETS, "-o", out, CUDA_SOURCE]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"libratio_jax: the CUDA kernel was not built ({e}): "
                  f"{str(getattr(e, 'stderr', None) or '')[-2000:]}")


setup(ext_modules=extensions, cmdclass={"build_ext": BuildWithCuda})
