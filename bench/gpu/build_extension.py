#!/usr/bin/env python3
"""Builds the sparsecar Python package where CMake's dependencies are missing (the GPU machine):
OUT/sparsecar/ with the pure-Python modules (copied) and the extension _sparsecar<EXT_SUFFIX>,
compiled by g++ for the interpreter running this script. Then PYTHONPATH=OUT imports sparsecar.

    python3 bench/gpu/build_extension.py OUT [--include DIR]...   # DIR: where fmt/ and spdlog/ are

Sources: python/src/*.cc and the .cc files of the sparsecar_client, sparsecar_common and
sparsecar_kernels targets, read from their CMakeLists.txt (what python/CMakeLists.txt compiles);
defines as CMake gives them (fmt and spdlog header-only); CUDA's include/ when it is there
($CUDA_HOME or /usr/local/cuda); $CXXFLAGS and $LDFLAGS are added (e.g. LDFLAGS=-lcudart).
pybind11 from torch's include/ (torch bundles it), else pybind11.get_include(), else
/usr/include. Objects are compiled in parallel and only when their source or a header is newer;
nothing is rebuilt when all is up to date.
"""

import argparse
import concurrent.futures
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = {"sparsecar_client": "client", "sparsecar_common": "common", "sparsecar_kernels": "kernels"}
DEFINES = ["-DFMT_HEADER_ONLY=1", "-DSPDLOG_FMT_EXTERNAL"]


def target_sources(target, folder):
    with open(os.path.join(ROOT, folder, "CMakeLists.txt")) as f:
        text = f.read()
    m = re.search(r"add_library\(\s*" + target + r"\s+(?:STATIC|SHARED)\s+([^)]*)\)", text)
    if not m:
        raise SystemExit(f"build_extension: no add_library({target} ...) in {folder}/CMakeLists.txt")
    return [os.path.join(ROOT, folder, s) for s in m.group(1).split() if s.endswith(".cc")]


def pybind11_include():
    try:
        import torch.utils.cpp_extension as ext  # noqa: F401 - only its include path
        for d in ext.include_paths():
            if os.path.exists(os.path.join(d, "pybind11", "pybind11.h")):
                return d
    except Exception:  # noqa: BLE001 - torch missing or odd: try the others
        pass
    try:
        import pybind11
        return pybind11.get_include()
    except ImportError:
        return "/usr/include"


def newest_header():
    newest = 0.0
    for folder in ("client", "common", "kernels", "python"):
        for path in glob.glob(os.path.join(ROOT, folder, "**", "*.h"), recursive=True):
            newest = max(newest, os.path.getmtime(path))
    return newest


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--include", action="append", default=[], help="extra include directory (fmt/, spdlog/)")
    p.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    p.add_argument("-j", type=int, default=os.cpu_count() or 2)
    args = p.parse_args(argv)

    sources = sorted(glob.glob(os.path.join(ROOT, "python", "src", "*.cc")))  # module.cc and any companions
    for target, folder in TARGETS.items():
        sources += target_sources(target, folder)
    pkg = os.path.join(args.out, "sparsecar")
    objdir = os.path.join(args.out, "obj")
    os.makedirs(pkg, exist_ok=True)
    os.makedirs(objdir, exist_ok=True)
    for src in glob.glob(os.path.join(ROOT, "python", "sparsecar", "*.py")):
        shutil.copy2(src, pkg)

    includes = [os.path.join(ROOT, d) for d in ("client/include", "common/include", "kernels/include", "kernels/src")]
    includes += args.include + [pybind11_include(), sysconfig.get_paths()["include"]]
    cuda_include = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")
    if os.path.exists(os.path.join(cuda_include, "cuda_runtime_api.h")):
        includes.append(cuda_include)  # harmless when unused; the hook's device path may want it
    flags = ["-O2", "-std=c++20", "-fPIC", "-fvisibility=hidden", "-pthread"] + DEFINES + \
        [f"-I{d}" for d in includes] + shlex.split(os.environ.get("CXXFLAGS", ""))
    headers = newest_header()

    def compile_one(src):
        obj = os.path.join(objdir, os.path.relpath(src, ROOT).replace(os.sep, "_") + ".o")
        if os.path.exists(obj) and os.path.getmtime(obj) >= max(os.path.getmtime(src), headers):
            return obj, None
        r = subprocess.run([args.cxx] + flags + ["-c", src, "-o", obj], capture_output=True, text=True)
        return obj, (r.stderr if r.returncode != 0 else None)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.j)) as pool:
        done = list(pool.map(compile_one, sources))
    errors = [err for _, err in done if err]
    if errors:
        sys.stderr.write(errors[0][-4000:])
        print(f"build_extension: {len(errors)} of {len(sources)} sources failed to compile", file=sys.stderr)
        return 1
    target = os.path.join(pkg, "_sparsecar" + sysconfig.get_config_var("EXT_SUFFIX"))
    objs = [o for o, _ in done]
    if os.path.exists(target) and os.path.getmtime(target) >= max(os.path.getmtime(o) for o in objs):
        print(f"build_extension: {target} is up to date")
        return 0
    link = [args.cxx, "-shared", "-pthread", "-o", target] + objs + shlex.split(os.environ.get("LDFLAGS", ""))
    r = subprocess.run(link, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stderr[-4000:])
        return 1
    check = subprocess.run([sys.executable, "-c", "import sparsecar, sparsecar.torch; print(sparsecar.__file__)"],
                           env=dict(os.environ, PYTHONPATH=args.out), capture_output=True, text=True)
    if check.returncode != 0:
        sys.stderr.write(check.stderr[-2000:])
        print("build_extension: built, but `import sparsecar.torch` fails", file=sys.stderr)
        return 1
    print(f"build_extension: built {target} from {len(sources)} sources")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
