#!/usr/bin/env python3
"""Import circles between the modules of pinfer's crates (python3, stdlib only).

For each crate root (the library `src/lib.rs`, the binary `src/bin/pinfer/main.rs`, `capi/src/lib.rs`,
`boards/qemu-virt/src/main.rs`) it walks the `mod x;` declarations (and `#[path = "..."]`) to the files
they name; one file is one module (inline `mod x { ... }` blocks, such as tests, count as their file).

What counts as module A depending on module B: A's code (comments and string literals left out, every
`cfg` taken) names a path that starts with `crate::`, `$crate::`, `super::` or `self::` (in `use` trees
too) and resolves to B: the longest prefix of the path that is a module. So a child's `super::Item` is
a dependency on its parent. What does not count: a module naming its own descendants (`mod b;`,
`pub use b::X`, `b::f()`, `self::b::`): the children are the parent's parts, and counting them would
make every parent whose children use `super::` items one circle with them. Paths into other crates
(`pinfer::`, `std::`) cannot form circles and are not followed. An item a module re-exports counts as
that module's, so a circle through a parent's re-export of its child's items is not seen; with
--reexports, a name a module re-exports (`pub use x::Item`, `pub use x::*`; items found by their
`fn`/`struct`/... keyword) counts as the module that defines it.

It prints every strongly connected component with more than one module (exit 1 if there is any);
with --order, first each crate's modules by height (a module above every module it names).
"""

import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CRATES = [
    ("pinfer (lib)", "src/lib.rs"),
    ("pinfer (bin)", "src/bin/pinfer/main.rs"),
    ("capi", "capi/src/lib.rs"),
    ("qemu-virt", "boards/qemu-virt/src/main.rs"),
]

STRIP = re.compile(
    r'//[^\n]*|/\*.*?\*/|b?r(#*)".*?"\1|b?"(?:\\.|[^"\\])*"|b?\'(?:\\.|[^\'\\])\'',
    re.S,
)
TOKEN = re.compile(
    r"(?P<use>\buse\s+(?P<tree>[^;]*);)"
    r"|(?P<modfile>(?P<attrs>(?:#\[[^\]]*\]\s*)*)(?:pub(?:\([^)]*\))?\s+)?mod\s+(?P<fname>\w+)\s*;)"
    r"|(?P<modopen>\bmod\s+(?P<iname>\w+)\s*\{)"
    r"|(?P<path>\$?\b(?:crate|super|self)(?:\s*::\s*\w+)+)"
    r"|(?P<open>\{)|(?P<close>\})"
)


ITEM = re.compile(r"\b(?:fn|struct|enum|const|static|trait|type|union)\s+(\w+)|\bmacro_rules!\s*(\w+)")
PUB_USE = re.compile(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]*);")


def strip(src):
    # Keep a character literal's neighbours apart; a lifetime ('a) is not a literal and stays.
    return STRIP.sub(lambda m: " " if m.group(0).startswith("/") else '""', src)


def use_paths(tree):
    """Expands a use tree (`crate::{a, b::{c, self}}`) into its paths, as lists of names."""
    pos = 0
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))

    def parse(prefix):
        nonlocal pos
        out = []
        while pos < len(tree):
            if tree[pos] == "{":
                pos += 1
                while pos < len(tree) and tree[pos] != "}":
                    out += parse(prefix)
                    if pos < len(tree) and tree[pos] == ",":
                        pos += 1
                pos += 1
                return out
            m = re.compile(r"\$?\w+|\*").match(tree, pos)
            if not m:
                return out
            pos = m.end()
            name = m.group(0)
            path = prefix if name in ("self", "*") and prefix else prefix + [name]
            if tree.startswith("::", pos):
                pos += 2
                prefix = path
                continue
            return out + [path]
        return out

    paths = []
    while pos < len(tree):
        paths += parse([])
        if pos < len(tree) and tree[pos] == ",":
            pos += 1
        elif pos < len(tree):
            pos += 1
    return paths


def crate_modules(root_file):
    """Maps each module path (a tuple of names) to its file, following `mod x;` declarations."""
    modules = {}

    def visit(path, file, own_dir):
        modules[path] = file
        with open(file, encoding="utf-8") as f:
            text = strip(f.read())
        for m in TOKEN.finditer(text):
            if not m.group("modfile"):
                continue
            name = m.group("fname")
            attr = re.search(r'#\[path\s*=\s*""\]', m.group("attrs") or "")
            if attr:
                # The literal was stripped: read it again from the raw text.
                raw = open(file, encoding="utf-8").read()
                lit = re.search(r'#\[path\s*=\s*"([^"]*)"\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+' + name + r"\b", raw)
                child = os.path.join(os.path.dirname(file), lit.group(1))
            else:
                child = os.path.join(own_dir, name + ".rs")
                if not os.path.exists(child):
                    child = os.path.join(own_dir, name, "mod.rs")
            if not os.path.exists(child):
                continue  # a cfg'd-out or generated module: nothing to read
            base = os.path.basename(child)
            child_dir = os.path.dirname(child) if base == "mod.rs" else os.path.join(os.path.dirname(child), base[:-3])
            visit(path + (name,), child, child_dir)

    visit((), root_file, os.path.dirname(root_file))
    return modules


def resolve(names, current, modules):
    """The module a path names from module `current` (inline modules included) and the rest of the
    path after it, or (None, [])."""
    names = [n.lstrip("$") for n in names]
    if not names or names[0] not in ("crate", "super", "self"):
        return None, []
    base = list(current)
    if names[0] == "crate":
        base, names = [], names[1:]
    while names and names[0] in ("super", "self"):
        if names[0] == "super":
            base = base[:-1]
        names = names[1:]
    full = base + names
    for n in range(len(full), -1, -1):
        if tuple(full[:n]) in modules:
            return tuple(full[:n]), full[n:]
    return None, []


def reexports(modules):
    """Per module, each name it re-exports from another module (`pub use x::Item`, `pub use x::*`)
    and the module that defines it (--reexports)."""
    texts = {}
    for mod, file in modules.items():
        with open(file, encoding="utf-8") as f:
            texts[mod] = strip(f.read())
    defined = {m: {a or b for a, b in ITEM.findall(t)} for m, t in texts.items()}
    table = {}
    for mod, text in texts.items():
        names = {}
        for tree in PUB_USE.findall(text):
            for p in use_paths(tree):
                p = p if p[0] in ("crate", "super", "self") else ["self"] + p
                whole, rest = resolve(p, mod, modules)
                if whole is not None and whole != mod and not rest:  # a module's every item
                    for n in defined[whole]:
                        names.setdefault(n, whole)
                elif whole is not None and whole != mod and len(rest) == 1 and rest[0] in defined[whole]:
                    names[rest[0]] = whole
        table[mod] = names
    return table


def crate_graph(root_file, follow_reexports=False):
    modules = crate_modules(root_file)
    rex = reexports(modules) if follow_reexports else {}
    edges = {m: set() for m in modules}
    for mod, file in modules.items():
        with open(file, encoding="utf-8") as f:
            text = strip(f.read())
        inline = []  # (name, brace depth at which it opened)
        depth = 0
        for m in TOKEN.finditer(text):
            current = mod + tuple(n for n, _ in inline)
            if m.group("open"):
                depth += 1
                continue
            if m.group("close"):
                depth -= 1
                if inline and inline[-1][1] == depth:
                    inline.pop()
                continue
            if m.group("modopen"):
                inline.append((m.group("iname"), depth))
                depth += 1
                continue
            if m.group("use"):
                paths = use_paths(m.group("tree"))
            elif m.group("path"):
                paths = [re.split(r"\s*::\s*", m.group("path"))]
            else:
                continue
            for p in paths:
                target, rest = resolve(p, current, modules)
                if target is None:
                    continue
                # An inline module is part of its file's module.
                while target not in edges:
                    target = target[:-1]
                seen = {target}
                while rest and rest[0] in rex.get(target, {}) and rex[target][rest[0]] not in seen:
                    target = rex[target][rest[0]]
                    seen.add(target)
                # A module's own descendants are its parts, not its dependencies.
                if target[: len(mod)] != mod:
                    edges[mod].add(target)
    return edges


def components(edges):
    """Tarjan's strongly connected components, in reverse topological order (dependencies first)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def levels(edges, comps):
    """Modules by height: a module's is one more than the highest it names (0: it names none)."""
    comp_of = {m: i for i, comp in enumerate(comps) for m in comp}
    height = []
    for i, comp in enumerate(comps):  # dependencies come first
        deps = [height[comp_of[t]] for m in comp for t in edges[m] if comp_of[t] != i]
        height.append(1 + max(deps) if deps else 0)
    rows = [[] for _ in range(max(height, default=-1) + 1)]
    for i, comp in enumerate(comps):
        rows[height[i]].append(" + ".join(name(m) for m in comp))
    return [sorted(r) for r in rows]


def name(mod):
    return "::".join(mod) or "(root)"


def main():
    order = "--order" in sys.argv[1:]
    follow = "--reexports" in sys.argv[1:]
    found = 0
    for crate, root_file in CRATES:
        edges = crate_graph(os.path.join(ROOT, root_file), follow)
        comps = components(edges)
        if order:
            print(f"{crate}: each module above every module it names")
            for level, mods in enumerate(levels(edges, comps)):
                print(f"  {level:2}: " + ", ".join(mods))
        for comp in comps:
            if len(comp) < 2:
                continue
            found += 1
            print(f"{crate}: circle of {len(comp)} modules:")
            members = set(comp)
            for m in comp:
                into = sorted(name(t) for t in edges[m] if t in members)
                print(f"  {name(m)} -> {', '.join(into)}")
    if found:
        print(f"{found} import circle(s)")
        return 1
    print("no import circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
