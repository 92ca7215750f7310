"""Builds the megatrain package with CMake (pyproject.toml has the metadata).

MEGATRAIN_BUILD_DIR names a CMake build folder to build in (scripts/test.sh passes its own, so that
nothing is compiled twice); by default the build goes to build/pip-<python version>, configured
without the tests and the GUI. Either way only the targets the package needs are built.
"""

import os
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # the wheel holds a compiled module: tag it for this platform
        return True


class CMakeBuildPy(build_py):
    def run(self):
        build = os.environ.get("MEGATRAIN_BUILD_DIR") or os.path.join(HERE, "build", f"pip-{sys.version_info[0]}.{sys.version_info[1]}")
        build = os.path.abspath(build)
        if not os.path.isfile(os.path.join(build, "CMakeCache.txt")):
            generator = ["-G", "Ninja"] if shutil.which("ninja") else []
            subprocess.check_call(["cmake", "-S", HERE, "-B", build, *generator, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                                   "-DMEGATRAIN_TESTS=OFF", "-DMEGATRAIN_GUI=OFF", "-DMEGATRAIN_PYTHON=ON",
                                   f"-DPython3_EXECUTABLE={sys.executable}"])
        jobs = os.environ.get("MEGATRAIN_JOBS") or str(os.cpu_count() or 1)
        subprocess.check_call(["cmake", "--build", build, "--target", "megatrain_python", "-j", jobs])
        package = os.path.join(build, "python", "megatrain")
        if not os.path.isfile(os.path.join(package, "__init__.py")):
            raise RuntimeError(f"{package} has no package: configure that build with -DMEGATRAIN_PYTHON=ON")
        target = os.path.join(self.build_lib, "megatrain")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(package, target, ignore=shutil.ignore_patterns("__pycache__"))


setup(distclass=BinaryDistribution, cmdclass={"build_py": CMakeBuildPy})
