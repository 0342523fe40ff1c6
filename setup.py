"""Build of ckpt_ext: the native module ckpt_ext._C, compiled with ninja through
torch.utils.cpp_extension.BuildExtension. Run with `pip install --no-build-isolation .` so that it
builds against the torch already installed (a build-isolated env would fetch another torch).

CUDA or not (environment, all optional):
  CKPT_EXT_CUDA=auto  (default) build the CUDA kernels when torch is a CUDA build and a CUDA
                      toolkit (nvcc) is found, a CPU-only extension otherwise;
  CKPT_EXT_CUDA=1     require the CUDA build: fail with a clear message if it cannot be made;
  CKPT_EXT_CUDA=0     CPU-only, even where CUDA is available.
  CUDA_HOME           the toolkit root; when unset it is derived from `nvcc` on PATH by asking nvcc
                      where it lives (a wrapper script in /usr/local/bin is seen through).
  TORCH_CUDA_ARCH_LIST  GPU architectures, e.g. "8.0;9.0". Default: the visible GPUs' own when a
                      GPU is visible at build time, else "9.0" (H100/H200; keeps CI builds short).

CPU vector width:
  CKPT_EXT_CPU_SIMD=auto  (default) on x86-64 build hosts with AVX2, FMA and F16C, compile the CPU
                      kernels for AVX2 (ATen's Vectorized<float> then uses 8-wide Sleef tanh; the
                      fused forward ran 5x and backward 8x faster than the baseline build on the
                      2-core CI machine). The result then needs an AVX2 CPU to run.
  CKPT_EXT_CPU_SIMD=none  portable baseline x86-64 build (tanh one element at a time).
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "9.0"


def _log(msg):
    print(f"ckpt_ext setup: {msg}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------
# Finding the CUDA toolkit. torch guesses CUDA_HOME as the folder above `nvcc` on PATH, which is
# wrong when nvcc is a wrapper (e.g. /usr/local/bin/nvcc exec'ing /usr/local/cuda-13.0/bin/nvcc):
# it then looks for cuda_runtime.h in /usr/local/include. So ask nvcc itself: a dry run prints the
# toolkit root as `TOP=...`. This must happen before torch.utils.cpp_extension is imported, since
# that module reads CUDA_HOME once, at import.

def _is_toolkit(root):
    return bool(root) and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")) and (
        os.path.isfile(os.path.join(root, "bin", "nvcc")))


def _toolkit_from_nvcc(nvcc):
    try:
        res = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        m = re.search(r"^#\$ TOP=(.+)$", res.stdout + res.stderr, re.MULTILINE)
        if m and _is_toolkit(os.path.realpath(m.group(1).strip())):
            return os.path.realpath(m.group(1).strip())
    except (OSError, subprocess.SubprocessError):
        pass
    # nvcc may be a symlink rather than a script
    root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return root if _is_toolkit(root) else None


def find_cuda_toolkit():
    """The toolkit root, or None. Honours CUDA_HOME / CUDA_PATH when set."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            root = os.environ[var]
            if not _is_toolkit(root):
                _log(f"{var}={root} has no bin/nvcc and include/cuda_runtime.h; ignoring it")
                continue
            return root
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        root = _toolkit_from_nvcc(nvcc)
        if root is not None:
            return root
    return "/usr/local/cuda" if _is_toolkit("/usr/local/cuda") else None


def wheel_cuda_include_dirs(torch_mod):
    """Headers of the CUDA libraries that torch's pip wheels ship (cuBLAS, cuSPARSE, cuSOLVER...):
    ATen/cuda/CUDAContext.h includes them, and a minimal toolkit may lack them. Newer wheels put
    them all in nvidia/cu<major>/include, older ones in nvidia/<lib>/include."""
    site = os.path.dirname(os.path.dirname(torch_mod.__file__))
    major = (torch_mod.version.cuda or "").split(".")[0]
    merged = os.path.join(site, "nvidia", f"cu{major}", "include")
    if major and os.path.isdir(merged):
        return [merged]
    return sorted(d for d in glob.glob(os.path.join(site, "nvidia", "*", "include"))
                  if os.path.isdir(d))


def want_cuda(torch_mod):
    mode = os.environ.get("CKPT_EXT_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"ckpt_ext setup: CKPT_EXT_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        _log("CKPT_EXT_CUDA=0: building the CPU-only extension")
        return False
    root = find_cuda_toolkit()
    problems = []
    if torch_mod.version.cuda is None:
        problems.append(f"torch {torch_mod.__version__} is not a CUDA build")
    if root is None:
        problems.append("no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)")
    if problems:
        if mode == "1":
            raise SystemExit("ckpt_ext setup: CKPT_EXT_CUDA=1 but the CUDA extension cannot be "
                             "built: " + "; ".join(problems))
        _log("building the CPU-only extension: " + "; ".join(problems))
        return False
    os.environ["CUDA_HOME"] = root
    _log(f"building the CUDA extension with the toolkit in {root} (torch CUDA "
         f"{torch_mod.version.cuda})")
    return True


# ------------------------------------------------------------------------------------------------

def cpu_simd_flags():
    """AVX2 flags for the CPU kernels when wanted and the build host has AVX2, FMA and F16C.

    CPU_CAPABILITY=AVX2 puts ATen's Vectorized types in their own inline namespace
    (at::vec::AVX2), as ATen's own per-ISA kernels do, so nothing clashes with other builds."""
    mode = os.environ.get("CKPT_EXT_CPU_SIMD", "auto").lower()
    if mode in ("none", "0", "off"):
        return []
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(re.search(r"^flags\s*:(.*)$", f.read(), re.M).group(1).split())
    except (OSError, AttributeError):
        flags = set()
    if {"avx2", "fma", "f16c"} <= flags:
        _log("CPU kernels built for AVX2 (CKPT_EXT_CPU_SIMD=none for a portable build)")
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    if mode == "avx2":
        raise SystemExit("ckpt_ext setup: CKPT_EXT_CPU_SIMD=avx2 but this CPU lacks AVX2/FMA/F16C")
    return []


def extensions():
    import torch

    with_cuda = want_cuda(torch)
    # Imported only now: it reads CUDA_HOME at import (see above).
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    include_dirs = [os.path.join(ROOT, "csrc")]
    extra = {"cxx": ["-O3"] + cpu_simd_flags()}
    if not with_cuda:
        return [CppExtension("ckpt_ext._C", sources, include_dirs=include_dirs,
                             extra_compile_args=extra)]

    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # No GPU to ask: torch would otherwise build for every arch it knows (slow).
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
    _log("TORCH_CUDA_ARCH_LIST=" + os.environ.get("TORCH_CUDA_ARCH_LIST", "(the visible GPUs')"))
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    # No --use_fast_math: its tanh approximation would cost the accuracy the tests hold us to.
    # -lineinfo lets compute-sanitizer and ncu point at source lines, at no runtime cost.
    extra["nvcc"] = ["-O3", "-lineinfo", "-DCKPT_EXT_WITH_CUDA"]
    extra["cxx"].append("-DCKPT_EXT_WITH_CUDA")
    return [CUDAExtension("ckpt_ext._C", sources,
                          include_dirs=include_dirs + wheel_cuda_include_dirs(torch),
                          extra_compile_args=extra)]


def build_ext_cmd():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


ext_modules = extensions()
setup(
    packages=find_packages(include=["ckpt_ext", "ckpt_ext.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext_cmd()},
)
