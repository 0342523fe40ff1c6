"""Build of ckpt_ext: the native module ckpt_ext._C, compiled with ninja through
torch.utils.cpp_extension.BuildExtension. Run with `pip install --no-build-isolation .` so that it
builds against the torch already installed (a build-isolated env would fetch another torch)."""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def extensions():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    extra = {"cxx": ["-O3"]}
    return [
        CppExtension(
            "ckpt_ext._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args=extra,
        )
    ]


setup(
    packages=find_packages(include=["ckpt_ext", "ckpt_ext.*"]),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
