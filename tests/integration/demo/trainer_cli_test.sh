#!/usr/bin/env bash
# The example trainer's command line (CLI11): --help, both "--flag value" and "--flag=value",
# numbers checked (a negative or non-numeric value, an unknown flag, a missing --socket and a
# rank outside the world are usage errors, exit 2), and a short --local run (no daemon) works.
set -uo pipefail
trainer=$1
fail() { echo "trainer_cli_test: $*" >&2; exit 1; }
expect() {  # expect <exit code> <what> -- args...
  local want=$1 what=$2; shift 3
  out=$("$trainer" "$@" 2>&1); got=$?
  [ "$got" -eq "$want" ] || fail "$what: exit $got, want $want: $trainer $*
$out"
}
expect 0 "help" -- --help
"$trainer" --help | grep -q -- "--local-compress" || fail "--help does not list --local-compress"
"$trainer" --help | grep -q "Problem shape" || fail "--help lacks the problem-shape group"
expect 0 "a short local run" -- --local --world-size 2 --steps 3 --log-every 0 --samples 400
expect 0 "--flag=value" -- --local --world-size=2 --steps=3 --log-every=0 --samples=400 --local-compress=topk
expect 2 "negative rank" -- --local --rank -1
expect 2 "non-numeric steps" -- --local --steps abc
expect 2 "trailing garbage" -- --local --lr 0.5x
expect 2 "unknown flag" -- --local --no-such-flag
expect 2 "unknown compress mode" -- --local --local-compress gzip
expect 2 "rank outside the world" -- --local --world-size 2 --rank 2
expect 2 "world of zero" -- --local --world-size 0
expect 2 "no socket without --local" -- --steps 3
out=$("$trainer" --steps abc 2>&1)
grep -q -- "--steps" <<< "$out" || fail "the error does not name --steps: $out"
echo "trainer_cli_test: ok"
