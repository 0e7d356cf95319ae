#!/usr/bin/env python3
"""Fails when a log or format call still carries a printf conversion.

Logging and Status messages use fmt-style format strings ("{}", "{:.3f}"; see
common/include/sparsecar/common/log.h). A printf conversion left in one ("%d", "%s", "%zu",
"%.3f") still compiles -- fmt ignores surplus arguments -- and prints the raw "%d", so this scan
runs in ctest (unit.printf_format_lint) to catch lines written against the old printf logger,
for instance on a branch merged after the move.

Checked: the format-string literals of SC_LOG_*(...), SC_CHECK(cond, ...), fmt::format(...) and
the transport's rate-limited loggers (`shed_log_.warn(...)`, `reject_log_.error(...)`) in C++ sources; and calls of the legacy printf helper strfmt() outside ALLOWED_STRFMT.
Usage: printf_format_lint.py <source root>   |   printf_format_lint.py --self-test
"""
import os
import re
import sys

CALL = re.compile(r'(?<![\w:])(SC_LOG_(?:ERROR|WARN|INFO|DEBUG|TRACE)|SC_CHECK|fmt::format|strfmt|\w+_log_\.(?:warn|error))\s*\(')
# %[flags][width][.precision][length]conversion; "%%" too. A space flag is left out on purpose:
# "5% of" would read as "% o".
PRINTF = re.compile(r'%(?:%|[-+#0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|z|j|t|L|q)?[diouxXeEfFgGcsp])')
LITERAL = re.compile(r'"((?:[^"\\\n]|\\.)*)"')
DIRS = ('common', 'kernels', 'policies', 'client', 'daemon', 'python', 'examples', 'bench', 'tests')
EXTS = ('.cc', '.h', '.cpp', '.hpp', '.cu', '.cuh')
# The one file still on the printf helper (its owner moves it to fmt::format), and its test.
ALLOWED_STRFMT = {os.path.join('python', 'src', 'module.cc'), os.path.join('tests', 'unit', 'common', 'log_test.cc')}


def call_args(src, start):
    """Top-level arguments of the call whose '(' ends just before `start`, as strings."""
    depth, i, arg_start, args = 0, start, start, []
    while i < len(src):
        c = src[i]
        if c in '"\'':
            i += 1
            while i < len(src) and src[i] != c:
                i += 2 if src[i] == '\\' else 1
        elif src.startswith('//', i):
            i = src.find('\n', i)
            if i < 0:
                break
            continue
        elif c in '([{':
            depth += 1
        elif c in ')]}':
            if depth == 0:
                args.append(src[arg_start:i])
                return args
            depth -= 1
        elif c == ',' and depth == 0:
            args.append(src[arg_start:i])
            arg_start = i + 1
        i += 1
    return args


def scan(text, rel):
    problems = []
    for m in CALL.finditer(text):
        line_start = text.rfind('\n', 0, m.start()) + 1
        line = text[line_start:text.find('\n', m.start())]
        if line.lstrip().startswith(('#define', '//', '*')):
            continue
        lineno = text.count('\n', 0, m.start()) + 1
        name = m.group(1)
        if name == 'strfmt':
            if rel not in ALLOWED_STRFMT and not line.lstrip().startswith('std::string strfmt'):
                problems.append(f'{rel}:{lineno}: strfmt() is the legacy printf helper; use fmt::format')
            continue
        args = call_args(text, m.end())
        index = 1 if name == 'SC_CHECK' else 0
        if len(args) <= index:
            continue
        for lit in LITERAL.findall(args[index]):
            bad = PRINTF.findall(lit)
            if bad:
                problems.append(f'{rel}:{lineno}: {name} format "{lit}" has printf conversion(s) '
                                f'{" ".join(bad)}; use {{}} / {{:.3f}} (fmt syntax)')
    return problems


def self_test():
    bad = [
        'SC_LOG_INFO("tensor %s has %zu elements", name, n);',
        'SC_CHECK(a == b, "kept %u of %llu", a, b);',
        'return invalid_argument(fmt::format("ratio %.3f", r));',
        'SC_LOG_WARN("first line "\n            "second %d", x);',
        'auto s = strfmt("x");',
        'SC_LOG_DEBUG("%-8s|%08x|%5.1f%%", a, b, c);',
        'refuse_log_.warn("rendezvous: refusing %s", who);',
    ]
    good = [
        'SC_LOG_INFO("tensor {} has {} elements (5% of them)", name, n);',
        'SC_CHECK(x % 2 == 0, "odd {}", x);',
        'std::printf("%d\\n", x);',
        'SC_LOG_ERROR("{:.3f} {:>8} {:016x}", a, b, c);',
        '#define SC_LOG(level, ...) log("%d", __VA_ARGS__)',
    ]
    failures = [s for s in bad if not scan(s, 'bad.cc')] + [s for s in good if scan(s, 'good.cc')]
    for s in failures:
        print('self-test: wrong verdict on: ' + s, file=sys.stderr)
    return 1 if failures else 0


def main():
    if sys.argv[1:] == ['--self-test']:
        return self_test()
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    if self_test():
        return 1
    root = sys.argv[1]
    problems, files = [], 0
    for top in DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = [d for d in dirnames if d not in ('corpus',) and not d.startswith('build')]
            for f in sorted(filenames):
                if f.endswith(EXTS):
                    path = os.path.join(dirpath, f)
                    with open(path, encoding='utf-8', errors='replace') as fh:
                        problems += scan(fh.read(), os.path.relpath(path, root))
                    files += 1
    for p in problems:
        print(p)
    if problems:
        print('scripts/printf-to-fmt FILE... rewrites such calls (review the diff, then build)')
    print(f'printf_format_lint: {files} files, {len(problems)} problem(s)', file=sys.stderr)
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
