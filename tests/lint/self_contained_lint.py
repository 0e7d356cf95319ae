#!/usr/bin/env python3
"""Fails when the repository points at files it does not contain.

Every `*.md` a tracked file names must exist in the repository (relative to the repository root,
to the naming file's folder, or as a file of that name somewhere in the tree, for a bare
"WIRE.md"), and nothing may point outside it: no parent-folder path to the team's notes, no
absolute path of the build machines, none of the team's private notes by name (the patterns in
OUTSIDE; docs/platform.md holds what users need of those notes).
Usage: self_contained_lint.py <source root>
"""
import os
import re
import subprocess
import sys

MD = re.compile(r'(?<![\w/.:-])((?:\.\./|\./|[\w-]+/)*[\w.-]+\.md)\b')
# Written with character classes so that this file does not itself name what it forbids.
OUTSIDE = re.compile(r'\.\./[s]hared/|/[w]ork/|\b(?:DESIG[N]|STYL[E]|ENVIRONMEN[T])\.md\b')
TEXT = ('.md', '.txt', '.py', '.sh', '.cc', '.h', '.cu', '.cuh', '.cmake', '.in', '.toml', '.example',
        '.service', '.json', '.yml', '.yaml', '')
SKIP_DIRS = ('tests/fuzz/corpus/',)
INSTALLED = ('share/', 'usr/', 'etc/')


def tracked(root):
    try:
        out = subprocess.run(['git', '-C', root, 'ls-files'], capture_output=True, text=True, check=True).stdout
        return [f for f in out.splitlines() if os.path.isfile(os.path.join(root, f))]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith(('build', '.'))]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
        return files


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = sys.argv[1]
    files = [f for f in tracked(root) if os.path.splitext(f)[1] in TEXT and not f.startswith(SKIP_DIRS)]
    basenames = {os.path.basename(f) for f in files}
    me = os.path.relpath(os.path.abspath(__file__), os.path.abspath(root))
    problems = []
    for f in files:
        if f == me:
            continue
        try:
            text = open(os.path.join(root, f), encoding='utf-8').read()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if 'http://' in line or 'https://' in line:
                line = re.sub(r'https?://\S+', '', line)
            m = OUTSIDE.search(line)
            if m:
                problems.append(f'{f}:{n}: points outside the repository ({m.group(0)})')
            for ref in MD.findall(line):
                if ref.startswith(INSTALLED):
                    continue  # a path of an installed tree (packaging/CMakeLists.txt), not of this one
                here = os.path.normpath(os.path.join(os.path.dirname(f), ref))
                if (os.path.exists(os.path.join(root, ref)) or os.path.exists(os.path.join(root, here))
                        or ('/' not in ref and ref in basenames)):
                    continue
                problems.append(f'{f}:{n}: names {ref}, which is not in the repository')
    for p in problems:
        print(p)
    print(f'self_contained_lint: {len(files)} files, {len(problems)} problem(s)', file=sys.stderr)
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
