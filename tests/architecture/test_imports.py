"""The import graph of src/saltgate, read from the source (ast; nothing is imported).

Arrows run one way: from tools and I/O shells down to the pure cores, never back. This
test fails on a cycle between modules or between packages, and on a pure module whose
imports (followed all the way down, package __init__ files included) reach an I/O or
clock library or a module outside the pure set. The rules are the lists below; a change
that needs a new entry should say why in its commit.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "saltgate"

# The functional core: no sockets, no event loop, no database, no clock (docs/design.md),
# so every decision there is testable without I/O. config.py is a parser.
PURE_PACKAGES = (
    "saltgate.derivations",
    "saltgate.policy",
    "saltgate.routing",
    "saltgate.ehbp",
    "saltgate.governance",  # limits and budgets: the time is an argument (docs/limits.md)
)
PURE_MODULES = (
    "saltgate",  # the package's own __init__
    "saltgate.config",
    "saltgate.secretfiles",  # the secret files' rules, config's and the store's (audit key)
    "saltgate.tables",  # the TOML table helpers [store] and [cluster] share
    "saltgate.prices",
    "saltgate.kvevents",  # a docstring: the modules below are the pure ones of the package
    "saltgate.kvevents.wire",
    "saltgate.kvevents.sanitize",
    "saltgate.kvevents.sequence",
    "saltgate.kvevents.settings",
    "saltgate.store",  # a docstring, so config.py can read store.settings alone
    "saltgate.store.settings",
    "saltgate.admin",  # a docstring, so the admin plane's rules can be loaded alone
    "saltgate.admin.scopes",  # scopes, routes, pinning: decided without the store
    "saltgate.epp",  # a docstring and a constant, so the EPP's Envoy configuration loads alone
    "saltgate.epp.envoy",  # the Envoy configuration printed and checked: plain dicts
    # The simulator's model of a replica: vLLM's hashing and block pool, its tokenizer,
    # request validation and errors. Its engine, server and metrics (a clock) are not.
    "saltgate.sim",
    "saltgate.sim.blockpool",
    "saltgate.sim.errors",
    "saltgate.sim.hashing",
    "saltgate.sim.protocol",
    "saltgate.sim.tokenizer",
)
# What a pure module must never load, directly or through another module.
IO_LIBRARIES = (
    "asyncio",
    "socket",
    "selectors",
    "ssl",
    "http",  # the standard library's http.client / http.server (saltgate.http is ours)
    "urllib.request",
    "subprocess",
    "multiprocessing",
    "threading",
    "signal",
    "sqlite3",
    "zmq",
    "httptools",
    "uvloop",
    "httpx",
    "openai",
    "psycopg",
    "psycopg_pool",
    "redis",
)
CLOCK_LIBRARIES = ("time", "datetime")
# The I/O side, named for the failure messages: a pure module importing one of these is
# also outside the pure set.
IO_PACKAGES = (
    "saltgate.http",
    "saltgate.gateway",
    "saltgate.serving",
    "saltgate.store.backends",
    "saltgate.store.ledger",
    "saltgate.store.pg_ledger",
    "saltgate.store.postgres",
    "saltgate.store.spool",
    "saltgate.store.sqlite",
    "saltgate.store.tenants",
    "saltgate.store.audit",
    "saltgate.store.admin_tokens",
    "saltgate.store.model_prices",
    "saltgate.admin.api",
    "saltgate.admin.store",
    "saltgate.admin.tokens",
    "saltgate.sim.engine",
    "saltgate.sim.run",
    "saltgate.sim.server",
    "saltgate.client",
    "saltgate.audit",
    "saltgate.kvevents.publisher",
    "saltgate.kvevents.relay",
    "saltgate.kvevents.subscriber",
    "saltgate.cli",
    "saltgate.demo",
    "saltgate.runtime",
)


@dataclass
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)
    edges: dict[str, set[str]] = field(default_factory=dict)  # module -> saltgate modules
    libraries: dict[str, set[str]] = field(default_factory=dict)  # module -> other imports

    def closure(self, start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in self.edges[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen


def _is_in(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Absolute names an import statement loads (``from a import b`` may load a.b)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".")[: len(module.split(".")) - node.level + is_package]
            name = ".".join([*base, node.module] if node.module else base)
        else:
            name = node.module or ""
        yield name
        yield from (f"{name}.{alias.name}" for alias in node.names)


def build_graph() -> Graph:
    graph = Graph()
    for path in sorted((SRC / ROOT).rglob("*.py")):
        graph.modules[_module_name(path)] = path
    for module, path in graph.modules.items():
        edges: set[str] = set()
        libraries: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for name in _imported(node, module, path.name == "__init__.py"):
                if name == ROOT or name.startswith(ROOT + "."):
                    # Loading a.b.c runs a/__init__ and a/b/__init__ first, except the
                    # packages that hold this module: they were loaded before it ran.
                    parts = name.split(".")
                    for i in range(1, len(parts) + 1):
                        target = ".".join(parts[:i])
                        if target in graph.modules and not _is_in(module, (target,)):
                            edges.add(target)
                elif name:
                    libraries.add(name)
        graph.edges[module] = edges
        graph.libraries[module] = libraries
    return graph


GRAPH = build_graph()


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), and self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _package(module: str) -> str:
    """saltgate.X for modules inside subpackage X; top-level modules stand for themselves."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_graph_is_read() -> None:
    assert len(GRAPH.modules) > 50
    assert "saltgate.derivations.encoding" in GRAPH.edges["saltgate.derivations.derive"]
    assert "zmq" in GRAPH.libraries["saltgate.kvevents.relay"]
    for name in (*PURE_PACKAGES, *PURE_MODULES, *IO_PACKAGES):
        assert any(_is_in(m, (name,)) for m in GRAPH.modules), f"{name}: no such module"


def test_routing_imports_nothing_from_the_store() -> None:
    """The router decides from events; persistence is the gateway's concern, and the
    table helpers it shares with the store live in saltgate.tables."""
    reached = {
        d for m in GRAPH.modules if _is_in(m, ("saltgate.routing",)) for d in GRAPH.closure(m)
    }
    assert sorted(d for d in reached if _is_in(d, ("saltgate.store",))) == []


def test_no_import_cycle_between_modules() -> None:
    assert _cycles(GRAPH.edges) == []


def package_edges(graph: Graph) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.edges.items():
        src = _package(module)
        deps = packages.setdefault(src, set())
        deps.update(t for t in map(_package, targets) if t not in (src, ROOT))
    return packages


def test_no_import_cycle_between_packages() -> None:
    assert _cycles(package_edges(GRAPH)) == []


def _pure(module: str) -> bool:
    return module in PURE_MODULES or _is_in(module, PURE_PACKAGES)


def purity_problems(graph: Graph) -> list[str]:
    problems = []
    for module in sorted(m for m in graph.modules if _pure(m)):
        for dep in sorted(graph.closure(module)):
            if not _pure(dep):
                kind = "an I/O module" if _is_in(dep, IO_PACKAGES) else "not a pure module"
                problems.append(f"{module} loads {dep}, {kind}")
            for lib in sorted(graph.libraries[dep]):
                if _is_in(lib, IO_LIBRARIES) or _is_in(lib, CLOCK_LIBRARIES):
                    via = "" if dep == module else f" (via {dep})"
                    problems.append(f"{module} loads {lib}{via}")
    return problems


def test_pure_modules_reach_no_io_clock_or_impure_module() -> None:
    assert purity_problems(GRAPH) == []


def _with(extra_edges: dict[str, set[str]], extra_libraries: dict[str, set[str]]) -> Graph:
    """GRAPH with a few imports added: the positive controls below."""
    edges = {m: set(t) | extra_edges.get(m, set()) for m, t in GRAPH.edges.items()}
    libraries = {m: set(t) | extra_libraries.get(m, set()) for m, t in GRAPH.libraries.items()}
    return Graph(dict(GRAPH.modules), edges, libraries)


def test_the_checks_see_what_they_guard_against() -> None:
    """Positive controls: the old derivations -> policy arrow is a package cycle; config.py
    importing the relay, or a pure module two hops away loading zmq or a clock, is found."""
    back = _with({"saltgate.derivations.derive": {"saltgate.policy.errors"}}, {})
    assert ["saltgate.derivations", "saltgate.policy"] in _cycles(package_edges(back))
    relay = _with({"saltgate.config": {"saltgate.kvevents.relay"}}, {})
    assert "saltgate.config loads saltgate.kvevents.relay, an I/O module" in purity_problems(relay)
    deep = _with(
        {}, {"saltgate.derivations.encoding": {"zmq.utils"}, "saltgate.routing.health": {"time"}}
    )
    found = purity_problems(deep)
    assert "saltgate.config loads zmq.utils (via saltgate.derivations.encoding)" in found
    assert "saltgate.routing.router loads time (via saltgate.routing.health)" in found


# What the two installs of docs/install.md bring beyond the standard library: the tools'
# libraries (extras) and saltgate-client's dependencies, by import name.
TOOL_LIBRARIES = ("numpy", "scipy", "matplotlib", "tqdm")
TOOL_PACKAGES = ("saltgate.audit",)
CLIENT_LIBRARIES = frozenset(
    {"httpx", "orjson", "cryptography", "pyhpke", "httptools", "uvloop", "openai"}
)
CLIENT_ENTRIES = ("saltgate.client", "saltgate.client.proxy")


def third_party(graph: Graph, modules: set[str]) -> dict[str, set[str]]:
    """Top-level names of the non-standard libraries each module loads (lazy imports too)."""
    found: dict[str, set[str]] = {}
    for module in sorted(modules):
        for lib in graph.libraries[module]:
            top = lib.partition(".")[0]
            if top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, set()).add(module)
    return found


def tool_library_problems(graph: Graph) -> list[str]:
    outside = {m for m in graph.modules if not _is_in(m, TOOL_PACKAGES)}
    found = third_party(graph, outside)
    return [f"{m} loads {lib}" for lib in TOOL_LIBRARIES for m in sorted(found.get(lib, ()))]


def client_library_problems(graph: Graph) -> list[str]:
    """Libraries the client's modules reach that saltgate-client does not install. The CLI
    is an entry, its subcommands' modules not: they are imported when run, and say what to
    install when missing (cli.main)."""
    reached = {m for m in graph.modules if m == "saltgate.cli" or m.startswith("saltgate.cli.")}
    for entry in CLIENT_ENTRIES:
        reached |= graph.closure(entry)
    found = third_party(graph, reached)
    return [f"{sorted(found[lib])} load {lib}" for lib in sorted(set(found) - CLIENT_LIBRARIES)]


def test_only_the_tools_load_the_tools_libraries() -> None:
    """`saltgate serve`, `up` and the SDK run without the `audit` extra."""
    assert tool_library_problems(GRAPH) == []


def test_the_client_loads_only_what_saltgate_client_installs() -> None:
    assert client_library_problems(GRAPH) == []


# The development projects beside the product (devkit/, benchmarks/): they import saltgate,
# never the other way, so its wheels can leave them out and its commands never load them.
DEV_PROJECTS = ("saltgate_bench", "saltgate_devkit")


def dev_project_problems(graph: Graph) -> list[str]:
    found = third_party(graph, set(graph.modules))
    return [f"{m} loads {lib}" for lib in DEV_PROJECTS for m in sorted(found.get(lib, ()))]


def test_the_product_imports_neither_the_benchmarks_nor_the_devkit() -> None:
    assert dev_project_problems(GRAPH) == []


def test_the_install_checks_see_a_stray_import() -> None:
    """Positive controls: the gateway loading numpy, the SDK reaching zmq via the relay,
    the CLI loading a benchmark (even lazily, as it once did) and a store the devkit."""
    numpy = _with({}, {"saltgate.gateway.metrics": {"numpy"}})
    assert tool_library_problems(numpy) == ["saltgate.gateway.metrics loads numpy"]
    dev = _with(
        {}, {"saltgate.cli": {"saltgate_bench.replay"}, "saltgate.store.db": {"saltgate_devkit"}}
    )
    assert dev_project_problems(dev) == [
        "saltgate.cli loads saltgate_bench",
        "saltgate.store.db loads saltgate_devkit",
    ]
    relay = _with({"saltgate.client.transport": {"saltgate.kvevents.relay"}}, {})
    assert any(p.endswith(" load zmq") for p in client_library_problems(relay))
