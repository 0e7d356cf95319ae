#!/usr/bin/env bash
# Installs the build tree into a temp prefix and checks what an operator and a C user get: the
# binaries, the systemd unit (pointing at the installed sparsecard), the example config and README
# in the doc directory, the dashboards, and sparsecar.pc -- then compiles and runs a tiny C program
# with `pkg-config --cflags --libs sparsecar` against the installed tree (when pkg-config exists).
# Usage: install_layout_test.sh <build dir> <source dir> [C compiler]   (env CONSUMER_FLAGS: sanitizers)
set -euo pipefail
build_dir=$1
src_dir=$2
cc=${3:-cc}
work=$(mktemp -d /tmp/sparsecar-install-XXXXXX)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
cmake --install "$build_dir" --prefix "$prefix" > "$work/install.log"

fail() { echo "install_layout_test: $*" >&2; exit 1; }
need() { [ -e "$prefix/$1" ] || fail "missing $1 (installed: $(cd "$prefix" && find . -type f | sort | tr '\n' ' '))"; }
find_one() { (cd "$prefix" && find . -path "./$1" | sed 's|^\./||' | head -1); }

need bin/sparsecard
need bin/sparsecarctl
need lib/systemd/system/sparsecard.service
need share/doc/sparsecar/sparsecard.toml.example
need share/doc/sparsecar/README.md
need share/sparsecar/dashboards/README.md
need share/sparsecar/dashboards/grafana/sparsecar.json
need share/sparsecar/dashboards/grafana/provisioning/dashboards/sparsecar.yml
need share/sparsecar/dashboards/prometheus/prometheus.yml
need share/sparsecar/dashboards/prometheus/alerts.yml
need include/sparsecar/sparsecar.h
pc=$(find_one '*/pkgconfig/sparsecar.pc')
[ -n "$pc" ] || fail "no sparsecar.pc under lib*/pkgconfig"

# The unit starts the sparsecard of this install's configured prefix, with its config file.
unit=$prefix/lib/systemd/system/sparsecard.service
configured_prefix=$(sed -n 's/^CMAKE_INSTALL_PREFIX:PATH=//p' "$build_dir/CMakeCache.txt")
grep -q "^ExecStart=$configured_prefix/bin/sparsecard --config /.*sparsecar/sparsecard.toml$" "$unit" ||
  fail "unexpected ExecStart in the unit: $(grep ExecStart "$unit")"
cmp -s "$src_dir/packaging/sparsecard.toml.example" "$prefix/share/doc/sparsecar/sparsecard.toml.example" ||
  fail "the installed example config differs from packaging/sparsecard.toml.example"
cmp -s "$src_dir/dashboards/grafana/sparsecar.json" "$prefix/share/sparsecar/dashboards/grafana/sparsecar.json" ||
  fail "the installed dashboard differs from dashboards/grafana/sparsecar.json"

if ! command -v pkg-config > /dev/null; then
  echo "install_layout_test: no pkg-config here; files checked, C program skipped"
  exit 0
fi
export PKG_CONFIG_PATH=$prefix/$(dirname "$pc")
version=$(pkg-config --modversion sparsecar)
[ "$version" = "$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$build_dir/CMakeCache.txt")" ] ||
  fail "pkg-config reports version '$version'"
cat > "$work/trainer.c" <<'C'
/* A C user of the installed client: no daemon here, so connecting fails cleanly. */
#include <stdio.h>
#include <sparsecar/sparsecar.h>
int main(void) {
  sc_client* client = NULL;
  sc_status s = sc_connect("/nonexistent/sparsecar.sock", 50, &client);
  printf("sc_connect: %s\n", sc_status_name(s));
  return s == SC_OK ? 1 : 0;
}
C
# shellcheck disable=SC2046,SC2086
"$cc" -std=c11 -Wall -Werror ${CONSUMER_FLAGS:-} -o "$work/trainer" "$work/trainer.c" $(pkg-config --cflags --libs sparsecar)
libdir=$(pkg-config --variable=libdir sparsecar)
LD_LIBRARY_PATH=$libdir "$work/trainer"
echo "install_layout_test: ok ($(cd "$prefix" && find . -type f | wc -l) files, pkg-config $version)"
