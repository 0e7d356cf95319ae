#!/usr/bin/env bash
# Installs the build tree into a temp prefix, then configures, builds and runs a separate project
# that finds it with find_package(sparsecar).
set -euo pipefail
build_dir=$1
src_dir=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d /tmp/sparsecar-package-XXXXXX)
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$src_dir/consumer" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS="${CONSUMER_CXX_FLAGS:-}" \
  -DCMAKE_EXE_LINKER_FLAGS="${CONSUMER_LINK_FLAGS:-}" > "$work/configure.log"
cmake --build "$work/build" > "$work/build.log"
LD_LIBRARY_PATH="$work/prefix/lib:$work/prefix/lib/x86_64-linux-gnu" "$work/build/consumer"
