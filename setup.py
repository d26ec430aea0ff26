"""Build: the pure-Python package always; the native CUDA catalog when nvcc is available and a
GPU is visible, or when TESSERA_CUDA_ARCHS asks for it (``csrc/build_native.install_archs``).

Environment:
    TESSERA_CUDA_ARCHS   architectures of the portable kernels, "80;90" where a GPU is visible (the
                         Hopper kernels build for sm_90a whenever 90 is listed); "90" alone for an
                         H100 / H200 only; set, it builds even without a GPU (a wheel, an image);
                         "none" skips the native library (the reference path still works)
    MAX_JOBS             parallel nvcc processes (default: CPU count)
"""

import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))


class BuildWithNative(build_py):
    """build_py that also compiles the native catalog into the package (when nvcc is present)."""

    def run(self):
        super().run()
        from build_native import build_native_library, install_archs  # csrc/build_native.py

        root = os.path.dirname(os.path.abspath(__file__))
        if getattr(self, "editable_mode", False):  # editable installs import from the source tree
            out_dir = os.path.join(root, "tessera_diffusers", "_native")
        else:
            out_dir = os.path.join(self.build_lib, "tessera_diffusers", "_native")
        archs, why = install_archs()
        print(f"tessera: {why}", flush=True)
        if archs is not None:
            build_native_library(out_dir, archs, log=lambda msg, level=2: print(msg, flush=True))


class PlatformWheel(bdist_wheel):
    """A wheel that carries the kernel library is tagged for its platform only
    (``py3-none-linux_x86_64``): the library is a plain C ABI with the CUDA runtime linked in, so
    neither the Python version nor torch's ABI matters. Without kernels the wheel stays pure."""

    def finalize_options(self):
        from build_native import find_nvcc, install_archs  # csrc/build_native.py

        super().finalize_options()
        self.root_is_pure = install_archs()[0] is None or find_nvcc() is None

    def get_tag(self):
        python, abi, platform = super().get_tag()
        return (python, abi, platform) if self.root_is_pure else ("py3", "none", platform)


setup(
    packages=find_packages(include=["tessera_diffusers", "tessera_diffusers.*"]) + ["tessera_diffusers.processors"],
    package_dir={"tessera_diffusers.processors": "processors"},
    package_data={"tessera_diffusers": ["_native/*.so", "_native/*.json", "data/*.json"]},
    cmdclass={"build_py": BuildWithNative, "bdist_wheel": PlatformWheel},
)
