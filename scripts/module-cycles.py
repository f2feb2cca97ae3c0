#!/usr/bin/env python3
"""Module graph of one crate (its crate::X references outside #[cfg(test)] code, lib.rs
re-exports resolved) and the cycles in it; exits 1 if there is one. Usage:
scripts/module-cycles.py crates/NAME/src [--quiet]"""
import os, re, sys
src = sys.argv[1]
mods = {}
for dp, dn, fn in os.walk(src):
    for f in fn:
        if not f.endswith('.rs'): continue
        p = os.path.join(dp, f)
        rel = os.path.relpath(p, src)[:-3]
        parts = rel.split('/')
        if parts[-1] in ('mod', 'lib', 'main'): parts = parts[:-1]
        if parts and parts[-1] == 'tests': continue
        top = parts[0] if parts else 'lib'
        text = open(p).read()
        cut = text.find('#[cfg(test)]')
        if cut >= 0: text = text[:cut]
        text = re.sub(r'//.*', '', text)
        mods.setdefault(top, set())
        # submodules reach their parent via super::, which stays inside one top module
        for m in re.findall(r'crate::(\w+)', text):
            mods[top].add(m)
tops = set(mods)
# re-exports in lib.rs: crate::Name -> module that defines it (pub use X::...)
lib = open(os.path.join(src, 'lib.rs')).read()
reexp = {}
for m, names in re.findall(r'pub use (\w+)::\{?([\w, ]+)\}?', lib):
    for n in names.split(','):
        reexp[n.strip()] = m
g = {}
for t, refs in mods.items():
    if t == 'lib': continue
    out = set()
    for r in refs:
        r2 = r if r in tops else reexp.get(r)
        if r2 and r2 != t and r2 != 'lib': out.add(r2)
    g[t] = out
if '--quiet' not in sys.argv:
    for t in sorted(g): print(f'{t} -> {", ".join(sorted(g[t]))}')
# Tarjan SCC
idx = {}; low = {}; st = []; on = set(); res = []; c = [0]
def sc(v):
    idx[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
    for w in g.get(v, ()):
        if w not in g: continue
        if w not in idx: sc(w); low[v] = min(low[v], low[w])
        elif w in on: low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: res.append(comp)
sys.setrecursionlimit(10000)
for v in g:
    if v not in idx: sc(v)
print(f"{src}: cycles:", res if res else "none")
sys.exit(1 if res else 0)
