"""Build of ckpt_ext: the native module ckpt_ext._C, compiled with ninja through
torch.utils.cpp_extension.BuildExtension. `pip install --no-build-isolation .` builds against the
torch already installed, offline; a plain `pip install .` builds against that same torch too, which
build_backend/installed_torch.py makes the isolated build's requirement.

CUDA or not (environment, all optional):
  CKPT_EXT_CUDA=auto  (default) build the CUDA kernels when torch is a CUDA build and a CUDA
                      toolkit (nvcc) is found, a CPU-only extension otherwise;
  CKPT_EXT_CUDA=1     require the CUDA build: fail with a clear message if it cannot be made;
  CKPT_EXT_CUDA=0     CPU-only, even where CUDA is available.
  CUDA_HOME           the toolkit root; when unset it is derived from `nvcc` on PATH by asking nvcc
                      where it lives (a wrapper script in /usr/local/bin is seen through).
  TORCH_CUDA_ARCH_LIST  GPU architectures, e.g. "8.0;9.0". Default: 8.0;8.6;8.9;9.0+PTX (A100,
                      consumer Ampere, Ada/L4, H100/H200, and PTX that the driver compiles for
                      anything newer), whatever GPU the build machine has or lacks. CI sets 9.0
                      to stay fast (.ci/run).

CPU kernels: built for every ISA level, chosen at run time. cpu/kernels.cpp is
compiled once per level with its own flags (DEFAULT: none; AVX2: -mavx2 -mfma -mf16c; AVX512:
-mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma; AVX levels on x86-64 only) and linked in
after the portable objects; every other source is compiled with no -m flag, so the module loads
and runs on any CPU of the architecture. The level runs from at::get_cpu_capability(), capped by
CKPT_EXT_CPU_CAPABILITY=default|avx2|avx512 at run time (csrc/cpu/dispatch.cpp).

The build's torch version goes into the module (ckpt_ext._C.TORCH_BUILD_VERSION; `import
ckpt_ext` refuses another major.minor, ckpt_ext/_native.py), and into the package's run-time
requirement: torch==<major>.<minor>.* of the torch that built it.
"""
import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# Where every build of this tree keeps its objects, one folder per platform and Python (setuptools'
# own name for it): the editable install (which would otherwise compile in a temporary folder
# and throw the objects away), `setup.py build_ext --inplace` and `pip wheel .` share it, so
# ninja recompiles only what changed, and a wheel built after an in-place build only links.
BUILD_TEMP = os.path.join(ROOT, "build",
                          f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")
# Data-center and consumer GPUs people have (A100, RTX 30xx/A-series, L4/RTX 40xx, H100/H200), and
# PTX of the newest for anything later (Blackwell runs it through the driver's JIT).
DEFAULT_ARCH_LIST = "8.0;8.6;8.9;9.0+PTX"


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


def cuda_include_dirs(torch_mod, toolkit_root):
    """The toolkit's own headers first, then the wheel's. A wheel may ship a newer CUDA minor
    release's headers than the toolkit's nvcc (torch 2.15: CUDA 13.2 headers beside nvcc 13.0),
    and cuda_runtime.h stops with "CUDA compiler and CUDA toolkit headers are incompatible" when it
    is not nvcc's own; nvcc's implicit include of its toolkit comes after every -I, so the toolkit's
    must be named, ahead of the rest. The wheel's fill in the libraries a minimal toolkit lacks."""
    toolkit = os.path.realpath(os.path.join(toolkit_root, "include"))
    wheel = [d for d in wheel_cuda_include_dirs(torch_mod) if os.path.realpath(d) != toolkit]
    return [toolkit] + wheel


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

# CPU ISA levels: (name, flags) of each copy of the per-ISA kernels. The names are ATen's
# CPU_CAPABILITY values, which also select ATen's Vectorized<T> implementation inside that copy.
# Per-file flags rather than `#pragma GCC target`: under the pragma GCC does not define __AVX2__,
# which ATen's vector headers (and sleef.h) test.
ISA_SOURCES = [os.path.join("csrc", "cpu", "kernels.cpp")]
# No FMA contraction: g = grad_out·(1 − t²) rounds the same at every level (csrc/cpu/kernels.h).
ISA_COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-Wno-unknown-pragmas"]  # (ATen's #pragma unroll)


def isa_levels():
    levels = [("DEFAULT", [])]
    if platform.machine().lower() in ("x86_64", "amd64"):
        levels += [("AVX2", ["-mavx2", "-mfma", "-mf16c"]),
                   ("AVX512", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"])]
    return [(name, flags + [f"-DCPU_CAPABILITY={name}", f"-DCPU_CAPABILITY_{name}"])
            for name, flags in levels]


def cuda_arch_list():
    """TORCH_CUDA_ARCH_LIST as given, else DEFAULT_ARCH_LIST (set in the environment, where
    torch's build reads it)."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() or DEFAULT_ARCH_LIST
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    return archs


# The oldest and newest torch releases CI builds and tests against (.ci/run: `make test-oldest`,
# `make test-newest`, and `make test` at the pinned default between them); csrc/autograd_node.cpp
# holds the code that differs between them. build_backend/installed_torch.py reads this line.
TESTED_TORCH = ((2, 11), (2, 15))


def check_torch_range(version):
    """Warn, not fail, outside the tested range: the build may work, but nothing here shows it."""
    major, minor = (int(p) for p in re.match(r"(\d+)\.(\d+)", version).groups())
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TORCH
    if not (lo_major, lo_minor) <= (major, minor) <= (hi_major, hi_minor):
        _log(f"torch {version} is outside the tested range {lo_major}.{lo_minor} to "
             f"{hi_major}.{hi_minor}: building anyway, untested")
        return False
    return True


def torch_requirement(version):
    """The run-time requirement matching the torch that builds: same major.minor (the C++ ABI of
    an extension holds within a minor release, not across)."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return f"torch=={major}.{minor}.*"


def extensions():
    import torch

    if os.environ.get("CKPT_EXT_CPU_SIMD"):
        _log("CKPT_EXT_CPU_SIMD is gone: every ISA level is built and one is chosen at run time "
             "(CKPT_EXT_CPU_CAPABILITY=default|avx2|avx512 caps it); ignoring it")
    check_torch_range(torch.__version__)
    with_cuda = want_cuda(torch)
    # Imported only now: it reads CUDA_HOME at import (see above).
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp")))
    sources = [s for s in sources if s not in ISA_SOURCES]  # built per level by BuildWithISA
    include_dirs = [os.path.join(ROOT, "csrc")]
    # -g0: Python's own CFLAGS (which every extension build starts from) carry -g; debug info
    # doubles the compile time of a file that includes torch's headers (autograd_node.cpp: 51 s
    # against 26 s) and makes the module ~80 MB. Symbols stay, so backtraces still name functions.
    cxx = ["-O3", "-g0", f'-DCKPT_EXT_TORCH_VERSION="{torch.__version__}"']
    cxx += [f"-DCKPT_EXT_CPU_{name}" for name, _ in isa_levels() if name != "DEFAULT"]
    # at::parallel_for is a header template whose OpenMP backend is `#pragma omp parallel`,
    # compiled into *our* objects: without -fopenmp the pragma is dropped and every CPU pass runs
    # on one thread (measured: the bf16 forward's tanh pass took 2x ATen's at 2 threads). The
    # GOMP_* symbols resolve at load time to the libgomp that libtorch_cpu already loaded, so no
    # second OpenMP runtime is linked in.
    if torch._C.has_openmp and sys.platform.startswith("linux"):
        cxx += ["-fopenmp"]
    extra = {"cxx": cxx}
    # setuptools relinks only when a file listed here or in sources is newer than the module;
    # ninja then rebuilds what changed. The per-ISA sources and the headers are not in sources.
    depends = sorted(glob.glob(os.path.join("csrc", "**", "*.*"), recursive=True))
    if not with_cuda:
        return [CppExtension("ckpt_ext._C", sources, include_dirs=include_dirs,
                             extra_compile_args=extra, depends=depends)]

    archs = cuda_arch_list()
    _log("TORCH_CUDA_ARCH_LIST=" + archs)
    sources += sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
    # No --use_fast_math: its tanh approximation would cost the accuracy the tests hold us to.
    # -lineinfo lets compute-sanitizer and ncu point at source lines, at no runtime cost.
    extra["nvcc"] = ["-O3", "-lineinfo", "-DCKPT_EXT_WITH_CUDA"]
    extra["cxx"] += ["-DCKPT_EXT_WITH_CUDA", f'-DCKPT_EXT_CUDA_ARCH_LIST="{archs}"']
    include_dirs += cuda_include_dirs(torch, os.environ["CUDA_HOME"])
    return [CUDAExtension("ckpt_ext._C", sources, include_dirs=include_dirs,
                          extra_compile_args=extra, depends=depends)]


def build_ext_cmd():
    from torch.utils.cpp_extension import BuildExtension

    class BuildWithISA(BuildExtension):
        """torch's BuildExtension (ninja) has one set of flags for every source. This compiles
        ISA_SOURCES once per ISA level with that level's flags, through the same (ninja-wrapped)
        compiler and the extension's own flags, each level in its own folder (its own
        build.ninja, so rebuilds stay incremental). The levels compile in threads, alongside the
        extension's own ninja run, and their objects join the link after the portable ones: where
        an inline function from a header is compiled into several objects, the linker keeps the
        first copy, which is then a portable one."""

        def finalize_options(self):
            super().finalize_options()
            self.build_temp = BUILD_TEMP

        def build_extension(self, ext):
            from concurrent.futures import ThreadPoolExecutor

            base = ext.extra_compile_args
            base_cxx = base["cxx"] if isinstance(base, dict) else list(base)
            compile_main = self.compiler.compile
            levels = isa_levels()
            with ThreadPoolExecutor(len(levels)) as pool:
                futures = [pool.submit(
                    compile_main, ISA_SOURCES,
                    output_dir=os.path.join(self.build_temp, f"isa_{name}"),
                    include_dirs=ext.include_dirs,
                    extra_postargs={"cxx": base_cxx + ISA_COMMON_FLAGS + flags, "nvcc": []})
                    for name, flags in levels]

                def isa_objects():
                    return [o for f in futures for o in f.result()]

                def compile_then_join(*args, **kwargs):
                    # The extension's own sources; then the levels' objects, for the link.
                    objects = compile_main(*args, **kwargs)
                    isa = isa_objects()
                    ext.extra_objects = [o for o in (ext.extra_objects or []) if o not in isa] + isa
                    return objects

                self.compiler.compile = compile_then_join
                try:
                    super().build_extension(ext)
                finally:
                    self.compiler.compile = compile_main
                isa_objects()  # a level's compile error is raised even where nothing else ran

    return BuildWithISA.with_options(use_ninja=True)


if __name__ == "__main__":  # also under pip (setuptools runs this file as __main__); tests import it
    import torch

    setup(
        packages=find_packages(include=["ckpt_ext", "ckpt_ext.*"]),
        ext_modules=extensions(),
        cmdclass={"build_ext": build_ext_cmd()},
        install_requires=[torch_requirement(torch.__version__)],
    )
