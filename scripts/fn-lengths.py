#!/usr/bin/env python3
"""Prints every Rust fn longer than --max lines (default 150), counted from its `fn` line to
its closing brace, with comments and string literals ignored; exits 1 if any. Usage:
scripts/fn-lengths.py [--max N] FILES_OR_DIRS..."""
import os, re, sys

FN = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?((const|async|unsafe|extern\s+"[^"]*")\s+)*fn\s+(\w+)')

def strip(src):
    """Source with comments, strings and char literals blanked (newlines kept)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith('//', i):
            j = src.find('\n', i)
            j = n if j < 0 else j
            out.append(' ' * (j - i)); i = j
        elif src.startswith('/*', i):
            j = src.find('*/', i + 2); j = n if j < 0 else j + 2
            out.append(re.sub(r'[^\n]', ' ', src[i:j])); i = j
        elif c == 'r' and re.match(r'r#*"', src[i:i+10]) and (i == 0 or not (src[i-1].isalnum() or src[i-1] == '_')):
            m = re.match(r'r(#*)"', src[i:]); close = '"' + m.group(1)
            j = src.find(close, i + len(m.group(0))); j = n if j < 0 else j + len(close)
            out.append(re.sub(r'[^\n]', ' ', src[i:j])); i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == '\\' else 1
            j += 1
            out.append(re.sub(r'[^\n]', ' ', src[i:j])); i = j
        elif c == "'":
            m = re.match(r"'(\\.|\\u\{[0-9a-fA-F]+\}|\\x..|[^\\'])'", src[i:])
            if m:
                out.append(' ' * len(m.group(0))); i += len(m.group(0))
            else:
                out.append(c); i += 1  # a lifetime
        else:
            out.append(c); i += 1
    return ''.join(out)

def fns(path):
    src = strip(open(path, encoding='utf-8').read())
    lines = src.split('\n')
    offs = [0]
    for l in lines:
        offs.append(offs[-1] + len(l) + 1)
    for ln, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        start = offs[ln]
        # The body's `{`; a `;` first means a declaration without body.
        k = start + m.end()
        depth_paren = 0
        while k < len(src):
            ch = src[k]
            if ch in '([<':
                depth_paren += 1 if ch != '<' else 0
            if ch in ')]':
                depth_paren -= 1
            if ch == ';' and depth_paren <= 0:
                k = -1; break
            if ch == '{' and depth_paren <= 0:
                break
            k += 1
        if k < 0 or k >= len(src):
            continue
        depth = 0
        j = k
        while j < len(src):
            if src[j] == '{': depth += 1
            elif src[j] == '}':
                depth -= 1
                if depth == 0: break
            j += 1
        end_line = src.count('\n', 0, j)
        yield m.group(5), ln + 1, end_line - ln + 1

def main():
    args = sys.argv[1:]
    mx = 150
    if args[:1] == ['--max']:
        mx = int(args[1]); args = args[2:]
    files = []
    for a in args:
        if os.path.isdir(a):
            for root, _, names in os.walk(a):
                files += [os.path.join(root, f) for f in names if f.endswith('.rs')]
        else:
            files.append(a)
    bad = 0
    for f in sorted(files):
        for name, line, n in fns(f):
            if n > mx:
                print(f'{f}:{line}: fn {name}: {n} lines'); bad += 1
    sys.exit(1 if bad else 0)

main()
