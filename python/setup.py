"""pip install ./python  — builds the sparsecar extension from the repository's C++ sources.

Debian 12 (PEP 668): `pip install --no-build-isolation --break-system-packages ./python` for
/usr/bin/python3, or in a venv that sees Debian's torch/numpy:
`python3 -m venv --system-site-packages v && v/bin/pip install --no-build-isolation ./python`.
(--no-build-isolation uses the installed setuptools instead of downloading one.)
Needs g++ >= 12 (C++20), python3-dev and pybind11 headers (Debian: pybind11-dev).
"""
import glob
import os
import sysconfig

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def rel(*parts):
    return os.path.relpath(os.path.join(ROOT, *parts), HERE)


sources = ["src/module.cc"]
for pattern in ("client/src/*.cc", "common/src/*.cc", "kernels/src/*.cc", "kernels/src/detail/*.cc"):
    sources += sorted(rel(p) for p in glob.glob(os.path.join(ROOT, pattern)))

include_dirs = [rel("client", "include"), rel("common", "include"), rel("kernels", "include"),
                rel("kernels", "src")]
try:
    import pybind11
    include_dirs.append(pybind11.get_include())
except ImportError:  # Debian's pybind11-dev puts the headers in /usr/include
    pass

cflags = ["-std=c++20", "-O2", "-fvisibility=hidden"]
# setuptools compiles C++ with CFLAGS of the interpreter; drop C-only flags gcc warns about.
os.environ.setdefault("CFLAGS", (sysconfig.get_config_var("CFLAGS") or "").replace("-Wstrict-prototypes", ""))

setup(
    name="sparsecar",
    version="0.1.0",
    description="Python client and PyTorch DDP hook for the sparsecar gradient-compression sidecar",
    packages=["sparsecar"],
    ext_modules=[Extension("sparsecar._sparsecar", sources=sources, include_dirs=include_dirs,
                           extra_compile_args=cflags, language="c++")],
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={"torch": ["torch>=1.13"]},
    zip_safe=False,
)
