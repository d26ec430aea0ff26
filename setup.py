"""Build: the pure-Python package always; the native CUDA catalog when nvcc is available.

Environment:
    TESSERA_CUDA_ARCHS   architectures of the portable kernels, "80;90" by default (the Hopper
                         kernels build for sm_90a whenever 90 is listed); "90" alone for an H100 /
                         H200 only; "none" to skip the native library (CPU-only install: the
                         reference path still works)
    MAX_JOBS             parallel nvcc processes (default: CPU count)
"""

import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))


class BuildWithNative(build_py):
    """build_py that also compiles the native catalog into the package (when nvcc is present)."""

    def run(self):
        super().run()
        from build_native import build_native_library  # csrc/build_native.py

        root = os.path.dirname(os.path.abspath(__file__))
        if getattr(self, "editable_mode", False):  # editable installs import from the source tree
            out_dir = os.path.join(root, "tessera_diffusers", "_native")
        else:
            out_dir = os.path.join(self.build_lib, "tessera_diffusers", "_native")
        build_native_library(out_dir, log=lambda msg, level=2: print(msg, flush=True))


setup(
    packages=find_packages(include=["tessera_diffusers", "tessera_diffusers.*"]) + ["tessera_diffusers.processors"],
    package_dir={"tessera_diffusers.processors": "processors"},
    package_data={"tessera_diffusers": ["_native/*.so", "_native/*.json", "data/*.json"]},
    cmdclass={"build_py": BuildWithNative},
)
