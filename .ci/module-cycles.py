#!/usr/bin/env python3
"""Module-level import cycles inside each crate of the workspace.

Walks each crate's module tree from src/lib.rs and src/main.rs (following
`mod x;`), collects the paths each file names (`use` trees, grouped ones
included, and inline `crate::`/`super::`/`self::` paths; comments and strings
are skipped), resolves each to the module that defines the item (following
`use` re-exports), and prints the strongly connected components of more than
one module. Edges between a module and its ancestors are left out of those
and listed apart, as 'parent/child', when they go both ways. Inline modules
(`mod tests { .. }`) count as part of their file. Exits 1 on any cycle.

Usage: .ci/module-cycles.py [--top] [CRATE_DIR ...]   (default: every crate;
--top: one node per top-level module instead of one per module file)
"""
import re, sys
from pathlib import Path

STRIP = re.compile(r'//[^\n]*|/\*.*?\*/|b?(?:r#*)?"(?:[^"\\]|\\.)*"#*|\'(?:[^\'\\\n]|\\.)\'|pub\s*\(\s*in\s[^)]*\)', re.S)
INLINE = re.compile(r'\b(crate|super|self)((?:\s*::\s*\w+)+)')

def expand(tree):  # "a::{b, c::{self, d as e}}" -> ["a::b", "a::c", "a::c::d as e"]
    i = tree.find('{')
    if i < 0:
        return [tree]
    prefix, body, depth, part, out = tree[:i], tree[i + 1:tree.rindex('}')], 0, '', []
    for ch in body + ',':
        depth += (ch == '{') - (ch == '}')
        if ch == ',' and depth == 0:
            out += [prefix.rstrip(':') if p == 'self' else prefix + p for p in expand(part.strip()) if p]
            part = ''
        else:
            part += ch
    return out

def regions(text, inner=()):  # [(inline module path, its text without nested inline modules)]
    rest, pos, out = '', 0, []
    for m in re.finditer(r'\bmod\s+(\w+)\s*\{', text):
        if m.start() >= pos:
            depth, end = 1, m.end()
            while depth:
                depth += {'{': 1, '}': -1}.get(text[end], 0)
                end += 1
            out += regions(text[m.end():end - 1], inner + (m.group(1),))
            rest, pos = rest + text[pos:m.start()], end
    return [(inner, rest + text[pos:])] + out

def crate_graph(src, root_file):
    mods, uses, refs = {}, {}, {}  # module -> text; (module, name) -> absolute path; module -> [path]
    def walk(file, mod, child_dir):
        mods[mod] = STRIP.sub(' ', file.read_text())
        for name in re.findall(r'\bmod\s+(\w+)\s*;', mods[mod]):
            for f in (child_dir / f'{name}.rs', child_dir / name / 'mod.rs'):
                if f.exists():
                    walk(f, mod + (name,), f.parent if f.name == 'mod.rs' else f.with_suffix(''))
                    break
    def absolute(at, segs):  # a path written in module `at` -> segments from the crate root; None: another crate
        if segs[0] == 'crate':
            return segs[1:]
        if segs[0] in ('super', 'self'):
            while segs and segs[0] == 'super':
                at, segs = at[:-1], segs[1:]
            return list(at) + (segs[1:] if segs and segs[0] == 'self' else segs)
        return list(at) + segs if at + (segs[0],) in mods else None
    def resolve(segs, seen=()):  # absolute path -> the module defining it
        mod = ()
        while segs and mod + (segs[0],) in mods:
            mod, segs = mod + (segs[0],), segs[1:]
        key = (mod, segs[0]) if segs else None
        return resolve(uses[key], seen + (key,)) if key in uses and key not in seen else mod
    walk(src / root_file, (), src)
    for mod, text in mods.items():
        paths = refs.setdefault(mod, [])
        for inner, chunk in regions(text):
            for tree in re.findall(r'\buse\s+([^;]+);', chunk):
                for path in expand(re.sub(r'\s*(::|\{|\}|,)\s*', r'\1', ' '.join(tree.split()))):
                    path, _, alias = path.partition(' as ')
                    segs = absolute(mod + inner, path.lstrip(':').split('::'))
                    if segs and segs[-1] != '*':
                        uses[(mod + inner, alias or segs[-1])] = segs
                        paths.append(segs)
            for head, tail in INLINE.findall(chunk):
                paths.append(absolute(mod + inner, [head] + re.sub(r'\s', '', tail).strip(':').split('::')))
    return {mod: {resolve(p) for p in paths if p is not None} for mod, paths in refs.items()}

def sccs(graph):  # Tarjan's
    index, low, stack, out = {}, {}, [], []
    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = [stack.pop()]
            while comp[-1] != v:
                comp.append(stack.pop())
            out.append(comp)
    for v in list(graph):
        if v not in index:
            visit(v)
    return out

def main(args):
    top = '--top' in args
    dirs = [Path(a) for a in args if a != '--top'] or [Path('.')] + sorted(p.parent for p in Path('.').glob('*/Cargo.toml'))
    name = lambda m: '::'.join(m) or 'crate'
    found = nested = 0
    for src, root_file in ((d / 'src', f) for d in dirs for f in ('lib.rs', 'main.rs')):
        if not (src / root_file).exists():
            continue
        graph = crate_graph(src, root_file)
        if top:
            collapsed = {}
            for m, ts in graph.items():
                collapsed.setdefault(m[:1], set()).update(t[:1] for t in ts)
            graph = collapsed
        related = lambda a, b: a[:len(b)] == b or b[:len(a)] == a
        siblings = {m: {t for t in ts if not related(m, t)} for m, ts in graph.items()}
        for comp in sorted(sorted(map(name, c)) for c in sccs(siblings) if len(c) > 1):
            found += 1
            print(f'{src / root_file}: cycle: {" <-> ".join(comp)}')
        for m, ts in sorted(graph.items()):
            for t in sorted(t for t in ts if len(t) < len(m) and m[:len(t)] == t and m in graph.get(t, ())):
                nested += 1
                print(f'{src / root_file}: parent/child: {name(t)} <-> {name(m)}')
    # A child using the items its parent declares (and the parent using the
    # child's) is how nested modules read; only sibling cycles fail.
    print(f'{found} sibling cycle(s), {nested} parent/child pair(s)' if found else f'no sibling module cycles ({nested} parent/child pair(s))')
    return 1 if found else 0

if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
