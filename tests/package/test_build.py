"""The build serves the user's machine, not the build host (setup.py, csrc/cpu/dispatch.cpp,
ckpt_ext/_native.py): no AVX code outside the per-ISA kernels, a baseline CPU runs the module, the
torch it was built with is recorded and enforced, the CUDA arch list covers current GPUs, and
the run-time requirement matches the build.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import runpy
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import ckpt_ext
from ckpt_ext import _C, _native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SO = _C.__file__
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _setup_module():
    """setup.py's functions, without running setup() (it only runs as __main__)."""
    path = os.path.join(ROOT, "setup.py")
    if not os.path.exists(path):
        pytest.skip("setup.py is not beside these tests (tests copied out of the source tree)")
    return runpy.run_path(path, run_name="ckpt_ext_setup_under_test")


# ------------------------------------------------------------------------------------------------
# CPU: portable outside the per-ISA kernels

_ISA_NAMESPACE = re.compile(r"::(AVX2|AVX512)::")
_FUNC = re.compile(r"^[0-9a-f]+ <(.*)>:$")


def avx_outside_isa_code(disassembly: str) -> dict[str, list[str]]:
    """Functions whose (demangled) name is in no ::AVX2:: or ::AVX512:: namespace but which
    contain a VEX/EVEX instruction (AVX and later: mnemonics v*, mask ops k*) or name a ymm,
    zmm or mask register. Baseline x86-64 code has none of these."""
    bad: dict[str, list[str]] = {}
    fn = None
    for line in disassembly.splitlines():
        m = _FUNC.match(line)
        if m:
            fn = m.group(1)
            continue
        parts = line.split("\t")
        if fn is None or len(parts) < 2 or _ISA_NAMESPACE.search(fn):
            continue
        ins = parts[-1].strip()
        mnemonic = ins.split()[0] if ins else ""
        if mnemonic.startswith(("v", "k")) or re.search(r"%[yz]mm\d|%k[0-7]\b", ins):
            bad.setdefault(fn, []).append(ins)
    return bad


def test_avx_checker_flags_what_it_must():
    sample = textwrap.dedent("""\
        0000000000001000 <ckpt_ext::tanh_cpu_(at::Tensor const&)>:
            1000:\tvmovups (%rdi),%ymm0
        0000000000002000 <void ckpt_ext::cpu::AVX2::(anonymous namespace)::tanh_kernel<float>(float*, long)>:
            2000:\tvmovups (%rdi),%ymm0
        0000000000003000 <c10::Half::Half(float)>:
            3000:\tvcvtps2ph $0x4,%xmm0,%xmm0
        0000000000004000 <ckpt_ext::cpu::kernels()>:
            4000:\tmovss  (%rdi),%xmm0
    """)
    assert set(avx_outside_isa_code(sample)) == {"ckpt_ext::tanh_cpu_(at::Tensor const&)",
                                                 "c10::Half::Half(float)"}


@pytest.mark.skipif(not X86, reason="x86-64 ISA levels only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) not installed")
def test_no_avx_instructions_outside_the_isa_kernels():
    """The portable code, and every inline function from a header that the linker kept, is
    baseline x86-64: an AVX2 copy of a shared inline function (a COMDAT the linker may pick from
    any object) would crash the DEFAULT path on a CPU without AVX2."""
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", SO], capture_output=True,
                         text=True, check=True).stdout
    n_isa = sum(1 for line in dis.splitlines() if _FUNC.match(line) and _ISA_NAMESPACE.search(line))
    assert n_isa >= 6, "no AVX2/AVX512 kernels found in the module: per-ISA objects not linked?"
    bad = avx_outside_isa_code(dis)
    assert not bad, "AVX code outside the ISA kernels: " + "; ".join(
        f"{fn}: {ins[0]}" for fn, ins in list(bad.items())[:10])


_BASELINE_SMOKE = r"""
import torch, ckpt_ext
from ckpt_ext import _C
assert torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
assert _C._cpu_capability() == "default" and list(_C._cpu_capabilities()) == ["default"]
g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 1e-2),
                   (torch.float16, 2e-3)):
    x = torch.randn(37, 11, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(19, 11, generator=g) / 4).to(dtype).requires_grad_()
    b = torch.randn(19, generator=g).to(dtype).requires_grad_()
    y = ckpt_ext.linear_tanh(x, w, b)
    y.backward(torch.ones_like(y))
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    yd = torch.tanh(torch.nn.functional.linear(xd, wd, bd))
    yd.backward(torch.ones_like(yd))
    for out, ref in ((y, yd), (x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err <= tol, (dtype, err)
print("BASELINE OK")
"""


@pytest.mark.skipif(not X86, reason="x86-64 only")
@pytest.mark.skipif(shutil.which("qemu-x86_64") is None,
                    reason="qemu-x86_64 not installed (Debian: apt-get install qemu-user)")
def test_runs_on_a_cpu_without_avx():
    """The module imports and computes correctly on an emulated Nehalem (SSE4.2, no AVX): the
    portable code and the DEFAULT kernels, chosen automatically. (The pre-dispatch build, with
    -mavx2 on every file, dies here with SIGILL.) ~1 min under emulation."""
    paths = [os.path.dirname(os.path.dirname(ckpt_ext.__file__))] + [p for p in sys.path if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    env.pop("CKPT_EXT_CPU_CAPABILITY", None)
    env.pop("ATEN_CPU_CAPABILITY", None)
    proc = subprocess.run(["qemu-x86_64", "-cpu", "Nehalem", os.path.realpath(sys.executable),
                           "-c", _BASELINE_SMOKE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "BASELINE OK" in proc.stdout, (proc.returncode,
                                                                  proc.stderr[-3000:])


# ------------------------------------------------------------------------------------------------
# torch versions: build and run time agree

@pytest.mark.skipif(shutil.which("nm") is None, reason="nm (binutils) not installed")
@pytest.mark.skipif(not (torch._C.has_openmp and sys.platform.startswith("linux")),
                    reason="torch's parallel backend here is not OpenMP on Linux")
def test_cpu_passes_are_openmp_parallel_regions():
    """at::parallel_for is a header template whose OpenMP backend is a `#pragma omp parallel`
    compiled into our own objects: built without -fopenmp, every CPU pass of ours silently ran on
    one thread. Built right, the module calls GOMP_parallel, resolved to torch's libgomp."""
    syms = subprocess.run(["nm", "-D", "--undefined-only", SO], capture_output=True, text=True,
                          check=True).stdout.split()
    assert "GOMP_parallel" in syms, "ckpt_ext's at::parallel_for loops were compiled without OpenMP"


def test_torch_build_version_recorded():
    assert _C.TORCH_BUILD_VERSION == torch.__version__
    with open(SO, "rb") as f:
        assert f"ckpt_ext-built-with-torch={torch.__version__}".encode() in f.read()


def test_version_read_from_the_file_is_this_interpreters_module():
    # Builds for other Pythons (and so possibly other torches) may sit beside it in the tree:
    # the version named when _C cannot load must be that of the module this interpreter loads.
    assert _native._version_in_file() == torch.__version__


def test_other_torch_minor_is_refused_naming_both():
    with pytest.raises(ImportError, match=r"built against torch 2\.14\.1\+cu130 but torch "
                                          r"2\.15\.0 is installed"):
        _native.check_versions("2.14.1+cu130", "2.15.0")
    _native.check_versions("2.14.1+cu130", "2.14.3")  # same minor: fine
    # end to end: the running torch claims another minor release
    code = "import torch; torch.__version__ = '1.13.0'; import ckpt_ext"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(ckpt_ext.__file__)))
    assert proc.returncode != 0
    assert f"built against torch {torch.__version__} but torch 1.13.0 is installed" in proc.stderr


def test_runtime_requirement_matches_the_build():
    setup = _setup_module()
    req = setup["torch_requirement"](torch.__version__)
    major, minor = torch.__version__.split(".")[:2]
    assert req == f"torch=={major}.{minor}.*"
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    assert re.search(r'^dynamic = \["dependencies"\]', pyproject, re.M)


def _minor(version):
    return tuple(int(p) for p in version.split(".")[:2])


def test_the_tested_torch_range_is_the_one_ci_builds():
    # setup.py's TESTED_TORCH runs from the Makefile's oldest torch (make test-oldest) to its
    # newest (make test-newest), the pinned default (make test) between them, and CI runs all
    # three; README and docs/install.md state that range; the build backend takes its torch from
    # the environment, not from a range written in pyproject.toml.
    setup = _setup_module()
    lo, hi = setup["TESTED_TORCH"]
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert _minor(re.search(r"^OLDEST_TORCH := (\S+)$", makefile, re.M).group(1)) == lo
    assert _minor(re.search(r"^NEWEST_TORCH := (\S+)$", makefile, re.M).group(1)) == hi
    reqs = open(os.path.join(ROOT, "requirements.txt")).read()
    assert lo <= _minor(re.search(r"^torch==(\S+)$", reqs, re.M).group(1)) <= hi
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    for leg in ("make test", "make test-oldest", "make test-newest"):
        assert re.search(rf"^(\w+=\S* )*{leg}$", ci, re.M), f".ci/run does not run {leg}"
    stated = f"{lo[0]}.{lo[1]} through {hi[0]}.{hi[1]}"
    assert f"**Supported torch: {stated}**" in open(os.path.join(ROOT, "README.md")).read()
    install = open(os.path.join(ROOT, "docs", "install.md")).read()
    assert f"**{stated}**" in install
    assert f"Outside {lo[0]}.{lo[1]}-{hi[0]}.{hi[1]} " in install
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    build_requires = re.search(r"^requires = \[(.*)\]$", pyproject, re.M).group(1)
    assert "torch" not in build_requires
    assert re.search(r'^build-backend = "installed_torch"$', pyproject, re.M)
    check = setup["check_torch_range"]
    assert check(f"{lo[0]}.{lo[1]}.0") and check(f"{hi[0]}.{hi[1]}.9+cu130")
    assert not check(f"{lo[0]}.{lo[1] - 1}.0") and not check(f"{hi[0]}.{hi[1] + 1}.0")
    assert lo <= _minor(torch.__version__) <= hi


def test_installed_metadata_requires_the_build_torch():
    """Where ckpt_ext is installed as a distribution (the wheel check in .ci/run), its metadata
    asks for the torch minor release it was built against. Only installed metadata counts: a
    source tree on sys.path holds the ckpt_ext.egg-info of whichever build ran there last."""
    sites = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
    init = os.path.realpath(ckpt_ext.__file__)
    for dist in importlib.metadata.distributions(name="ckpt_ext", path=sites):
        if init in (os.path.realpath(dist.locate_file(f)) for f in (dist.files or [])):
            break
    else:
        pytest.skip("no installed ckpt_ext distribution holds the imported package (an editable "
                    "install lists no package files)")
    major, minor = _C.TORCH_BUILD_VERSION.split(".")[:2]
    assert [r for r in dist.requires or [] if r.startswith("torch")] == [
        f"torch=={major}.{minor}.*"]


# ------------------------------------------------------------------------------------------------
# CUDA architectures

def test_default_cuda_arch_list(monkeypatch):
    setup = _setup_module()
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert setup["cuda_arch_list"]() == "8.0;8.6;8.9;9.0+PTX"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert setup["cuda_arch_list"]() == "9.0"


def test_toolkit_headers_come_before_the_wheels(tmp_path):
    # torch 2.15's wheel carries CUDA 13.2 headers, which nvcc 13.0 refuses ("CUDA compiler and
    # CUDA toolkit headers are incompatible") when they are found before its own (make
    # test-newest builds exactly that pair).
    setup = _setup_module()
    (tmp_path / "include").mkdir()
    dirs = setup["cuda_include_dirs"](torch, str(tmp_path))
    wheel = setup["wheel_cuda_include_dirs"](torch)
    assert dirs == [os.path.realpath(tmp_path / "include")] + wheel


def fatbin_archs(data: bytes) -> tuple[set[int], set[int]]:
    """(SASS archs, PTX archs) of the CUDA fatbinaries embedded in a binary, e.g. ({80, 90}, {90}).

    No cuobjdump needed (a minimal toolkit lacks it). A fatbinary is a 16-byte header (magic
    0xBA55ED50, u16 version, u16 header size, u64 size) followed by entries whose header holds
    u16 kind (1 = PTX, 2 = ELF/SASS) at 0, u32 header size at 4, u64 payload size at 8 and the
    u32 arch (80 = sm_80) at 28."""
    sass, ptx = set(), set()
    pos = 0
    while (i := data.find(b"\x50\xed\x55\xba", pos)) >= 0:
        hsize = struct.unpack_from("<H", data, i + 6)[0]
        size = struct.unpack_from("<Q", data, i + 8)[0]
        if hsize != 16 or i + hsize + size > len(data):
            pos = i + 4
            continue
        j, end = i + hsize, i + hsize + size
        while j + 32 <= end:
            kind, _, ehsize = struct.unpack_from("<HHI", data, j)
            payload = struct.unpack_from("<Q", data, j + 8)[0]
            arch = struct.unpack_from("<I", data, j + 28)[0]
            {1: ptx, 2: sass}.get(kind, set()).add(arch)
            if ehsize == 0:
                break
            j += ehsize + payload
        pos = end
    return sass, ptx


def _arch_list_numbers(arch_list: str) -> tuple[set[int], set[int]]:
    sass, ptx = set(), set()
    for a in arch_list.replace(",", ";").split(";"):
        num = int(a.replace("+PTX", "").replace(".", ""))
        sass.add(num)
        if a.endswith("+PTX"):
            ptx.add(num)
    return sass, ptx


def test_fatbin_parser_on_a_made_up_binary():
    def entry(kind, arch, payload):
        return struct.pack("<HHIQIIHHI", kind, 0, 32, len(payload), 0, 0, 0, 0, arch) + payload
    body = entry(2, 80, b"x" * 8) + entry(2, 90, b"y" * 16) + entry(1, 90, b"ptx!")
    blob = b"junk" + struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body + b"tail"
    assert fatbin_archs(blob) == ({80, 90}, {90})
    assert _arch_list_numbers("8.0;8.6;8.9;9.0+PTX") == ({80, 86, 89, 90}, {90})


@pytest.mark.skipif(not ckpt_ext.WITH_CUDA, reason="CPU-only build (ckpt_ext.WITH_CUDA is False)")
def test_cuda_binary_holds_the_arch_list():
    """The module's fatbinary holds SASS for every arch of the list it was built with, and PTX
    where the list says +PTX (a default build: sm_80, 86, 89, 90 and PTX 9.0)."""
    with open(SO, "rb") as f:
        got = fatbin_archs(f.read())
    assert got == _arch_list_numbers(_C.CUDA_ARCH_LIST), (got, _C.CUDA_ARCH_LIST)


# ------------------------------------------------------------------------------------------------
# scripts/check_requirements.py: what lets scripts/setup.sh skip pip (offline re-runs)

def _check(tmp_path, text):
    p = tmp_path / "req.txt"
    p.write_text(text)
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "check_requirements.py"),
                           str(p)], capture_output=True, text=True, timeout=120)


def test_check_requirements(tmp_path):
    if not os.path.exists(os.path.join(ROOT, "scripts", "check_requirements.py")):
        pytest.skip("scripts/ is not beside these tests")
    ok = _check(tmp_path, f"# comment\ntorch=={torch.__version__.split('+')[0]}\npytest\n\n")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    missing = _check(tmp_path, "pytest\nno-such-package-ckpt-ext-test>=1\n")
    assert missing.returncode == 1 and "no-such-package-ckpt-ext-test" in missing.stdout
    old = _check(tmp_path, "torch<1.0\n")
    assert old.returncode == 1 and "torch" in old.stdout
