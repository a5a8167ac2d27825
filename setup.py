"""Builds the native INT8 kernels (qtool.kernels._native) at install time.

Each ISA variant is compiled from the same sources with per-function target
attributes, so one portable binary carries AVX-512 VNNI, AVX2 and plain C paths
and picks one at run time from the CPU's features.
"""
import glob
import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_py import build_py


class BuildPyWithPresets(build_py):
    """Ship the preprocessing presets (configs/*.toml, the one copy in the repository) inside the
    package as qtool/data/presets, where an installed qtool finds them by name."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "qtool", "data", "presets")
        os.makedirs(dst, exist_ok=True)
        for f in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "*.toml"))):
            shutil.copy(f, dst)


sources = sorted(glob.glob("qtool/kernels/src/*.c"))
args = ["-O3", "-std=c11", "-fno-strict-aliasing"] if sys.platform != "win32" else ["/O2"]
# gnu11 for posix_memalign; no FMA contraction so float epilogues match numpy bit for bit
kargs = (["-O3", "-std=gnu11", "-fno-strict-aliasing", "-ffp-contract=off", "-fno-math-errno",
          "-Wall", "-Wno-unused-function", "-pthread"] if sys.platform != "win32" else ["/O2"])
ext = [Extension("qtool.kernels._native", sources=sources, include_dirs=["qtool/kernels/src"],
                 depends=sorted(glob.glob("qtool/kernels/src/*.h")),
                 extra_compile_args=kargs,
                 extra_link_args=["-pthread"] if sys.platform != "win32" else [])] if sources else []
# the calibration histogram's one-pass update (plain C, no ISA-specific code)
ext.append(Extension("qtool.calibrate._histogram", sources=["qtool/calibrate/src/histogram.c"],
                     include_dirs=["qtool/src"], depends=["qtool/src/isa_choice.h"], extra_compile_args=args))
# output-aware rounding's coordinate descent (plain C, float64 in the numpy reference's order)
ext.append(Extension("qtool.quantize._rounding", sources=["qtool/quantize/src/rounding.c"],
                     extra_compile_args=kargs, extra_link_args=["-pthread"] if sys.platform != "win32" else []))
# channel pairing's cost matrix (float32 sums in the numpy reference's order; AVX-512F, AVX2 and portable
# paths of the same loops: without trapping math the compiler vectorises their selects, same results)
ext.append(Extension("qtool.fuse._pair_cost", sources=["qtool/fuse/src/pair_cost.c"],
                     include_dirs=["qtool/src"], depends=["qtool/src/isa_choice.h"],
                     extra_compile_args=kargs + (["-fno-trapping-math"] if sys.platform != "win32" else []),
                     extra_link_args=["-pthread"] if sys.platform != "win32" else []))
if os.environ.get("QTOOL_NO_EXTENSIONS"):  # packaging tests: what goes into the wheel, without compiling
    ext = []
setup(ext_modules=ext, cmdclass={"build_py": BuildPyWithPresets})
