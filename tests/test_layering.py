"""The layering rules, read from the source.

- Installed, the project is one import name, ``kvshare``: nothing imports the folders
  ``actors``/``router`` by their top-level names (they are ``kvshare.actors``/``kvshare.router``).
- Dependency direction ``router -> actors -> kvshare`` and ``router -> kvshare``: the library
  (``kvshare/``) imports neither ``kvshare.actors`` nor ``kvshare.router``, and ``kvshare.actors``
  never imports ``kvshare.router``; neither with an import statement (also inside functions and
  ``TYPE_CHECKING``) nor by naming them to ``import_module``/``__import__``.
- The worker SDK (``kvshare/client/``) and the vLLM integration (``kvshare/vllm/``) import
  nothing from ``kvshare/engines/`` (the reference engine is one engine on the SDK, vLLM another).
- ``kvshare/testing/`` is for tests, benchmarks and the demo: the rest of the library never
  imports it.
- No import cycles among the project's modules.
- Nothing imports ``examples/`` (a user copies from it).
- The subsystem folders exist (DESIGN.md, "Layout").

Each rule is checked against a planted violation too, so a checker that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OLD_NAMES = ("actors", "router")
ACTORS, ROUTER = "kvshare.actors", "kvshare.router"
FOLDERS = (
    "kvshare/client", "kvshare/pool", "kvshare/tiers", "kvshare/transfer/holder",
    "kvshare/transfer/reader", "kvshare/vllm/connector", "kvshare/vllm/events",
    "kvshare/vllm/server", "kvshare/engines", "kvshare/testing", "kvshare/_native",
    "actors/index", "router/core", "router/gateway", "router/serve", "router/sim", "router/web",
)


def imported(source: str) -> set[str]:
    """Every module ``source`` imports: statements (also inside functions and
    ``TYPE_CHECKING``) and string arguments of ``import_module``/``__import__``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.add(arg.value)
    return out


def reaches(modules: Iterable[str], packages: tuple[str, ...]) -> list[str]:
    """The modules of ``modules`` that are one of ``packages`` or inside one."""
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


def module_name(path: Path) -> str:
    """The installed name of a source file: ``actors/x.py`` is ``kvshare.actors.x``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in OLD_NAMES:
        parts.insert(0, "kvshare")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> dict[str, Path]:
    """Every module of the package, by installed name (the links ``kvshare/actors`` and
    ``kvshare/router`` are not walked twice)."""
    out: dict[str, Path] = {}
    for folder in ("kvshare", "actors", "router"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT).parts
            if rel[0] == "kvshare" and rel[1] in OLD_NAMES:
                continue
            out[module_name(p)] = p
    return out


MODULES = sources()
LIBRARY = sorted(m for m in MODULES if not reaches([m], (ACTORS, ROUTER)))
CLUSTER = sorted(reaches(MODULES, (ACTORS,)))
SDK = sorted(reaches(MODULES, ("kvshare.client", "kvshare.vllm")))


def graph(modules: Mapping[str, str]) -> dict[str, set[str]]:
    """``module -> the known modules it imports`` from each module's source text."""
    out = {}
    for name, source in modules.items():
        out[name] = {m for m in imported(source) if m in modules and m != name}
    return out


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_checker_sees_every_way_of_importing() -> None:
    planted = (
        "import actors.deploy\n"
        "from kvshare.router import embed\n"
        "def f():\n    from kvshare.actors.index_client import IndexClient\n"
        "import importlib\nimportlib.import_module('kvshare.router.serve')\n"
        "__import__('actors.config')\n"
        "from kvshare.engines.kv_convert import block_view\n"
    )
    found = imported(planted)
    assert reaches(found, (ACTORS, ROUTER)) == [
        "kvshare.actors.index_client", "kvshare.actors.index_client.IndexClient",
        "kvshare.router", "kvshare.router.embed", "kvshare.router.serve"]
    assert reaches(found, OLD_NAMES) == ["actors.config", "actors.deploy"]
    assert reaches(found, ("kvshare.engines",)) == ["kvshare.engines.kv_convert",
                                                     "kvshare.engines.kv_convert.block_view"]
    assert reaches(imported("import actorsx\nfrom kvshare.engines_x import y\n"),
                   OLD_NAMES + ("kvshare.engines",)) == []


def test_the_cycle_finder_sees_a_planted_cycle() -> None:
    planted = {"a": "import b\n", "b": "def f():\n    from c import x\n", "c": "import a\n",
               "d": "import a\n"}
    assert cycles(graph(planted)) == [["a", "b", "c"]]
    assert cycles(graph({"a": "import b\n", "b": ""})) == []


def test_the_module_names_are_the_installed_ones() -> None:
    assert module_name(ROOT / "actors/index/client.py") == "kvshare.actors.index.client"
    assert module_name(ROOT / "router/core/__init__.py") == "kvshare.router.core"
    assert module_name(ROOT / "kvshare/pool/tiered.py") == "kvshare.pool.tiered"
    assert "kvshare.router.core.routing" in MODULES and "kvshare.actors.deploy" in MODULES


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_subsystem_folders_exist(folder: str) -> None:
    assert (ROOT / folder / "__init__.py").is_file(), f"{folder}/ is not a package"


def test_actors_and_router_install_under_kvshare() -> None:
    for name in OLD_NAMES:
        link = ROOT / "kvshare" / name
        assert link.is_symlink() and link.resolve() == (ROOT / name).resolve(), (
            f"kvshare/{name} must link to the top-level {name}/ (mypy and a checkout see "
            f"kvshare.{name} through it)")


@pytest.mark.parametrize("folder", ["kvshare", "actors", "router", "tests", "benchmarks",
                                    "examples"])
def test_nothing_imports_the_old_top_level_names(folder: str) -> None:
    bad = {str(p.relative_to(ROOT)): reaches(imported(p.read_text()), OLD_NAMES)
           for p in sorted((ROOT / folder).rglob("*.py"))
           if not (folder == "kvshare" and p.relative_to(ROOT).parts[1] in OLD_NAMES)}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"import kvshare.actors / kvshare.router instead: {bad}"


@pytest.mark.parametrize("name", LIBRARY)
def test_the_library_never_imports_actors_or_router(name: str) -> None:
    bad = reaches(imported(MODULES[name].read_text()), (ACTORS, ROUTER))
    assert not bad, f"{name} imports {bad}: the library sits below them"


@pytest.mark.parametrize("name", CLUSTER)
def test_actors_never_import_the_router(name: str) -> None:
    bad = reaches(imported(MODULES[name].read_text()), (ROUTER,))
    assert not bad, f"{name} imports {bad}: kvshare.actors sits below kvshare.router"


@pytest.mark.parametrize("name", SDK)
def test_the_sdk_and_vllm_never_import_the_reference_engine(name: str) -> None:
    bad = reaches(imported(MODULES[name].read_text()), ("kvshare.engines",))
    assert not bad, f"{name} imports {bad}: kvshare/engines/ sits on top of the SDK"


def test_only_tests_benchmarks_and_the_demo_use_kvshare_testing() -> None:
    users = [m for m in MODULES if not reaches([m], ("kvshare.testing",))
             and reaches(imported(MODULES[m].read_text()), ("kvshare.testing",))]
    assert not users, f"{users} import kvshare.testing, which is for tests and benchmarks only"


def test_there_are_no_import_cycles() -> None:
    found = cycles(graph({m: p.read_text() for m, p in MODULES.items()}))
    assert not found, f"import cycles: {found}"


def test_nothing_imports_examples() -> None:
    users = [p for folder in ("kvshare", "actors", "router", "tests", "benchmarks", "examples")
             for p in sorted((ROOT / folder).rglob("*.py"))
             if reaches(imported(p.read_text()), ("examples",))]
    assert not users, f"{[str(p.relative_to(ROOT)) for p in users]} import examples/"


def test_tests_mirror_the_packages() -> None:
    """A test module sits in the folder of the package it tests (``tests/router/gateway/`` for
    ``router/gateway/``); only repository-wide checks stay at the top of ``tests/``."""
    stray = []
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = p.relative_to(ROOT / "tests").parent
        if rel == Path("."):
            continue
        if not (ROOT / rel / "__init__.py").is_file():
            stray.append(str(p.relative_to(ROOT)))
    assert not stray, f"{stray} sit in folders that mirror no package"
