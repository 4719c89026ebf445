"""The layering rule, read from the source: the library never reaches up.

``kvshare/`` (the library and SDK) imports nothing from ``actors`` (the Ray cluster layer) or
``router`` (routing), neither with an import statement nor by naming them to
``import_module``/``__import__``; the worker SDK (``kvshare/client.py``,
``kvshare/client_local.py``) and the vLLM connector (``kvshare/vllm/``) import nothing
from ``kvshare/engines/`` (the reference engine is one engine on the SDK, vLLM another); nothing imports
``examples/`` (a user copies from it). Each rule is checked against a planted violation too,
so a checker that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UPPER = ("actors", "router")
SDK = ("kvshare/client.py", "kvshare/client_local.py",
       *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvshare/vllm").rglob("*.py")))


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


def reaches(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    """The modules of ``modules`` that are one of ``packages`` or inside one."""
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_the_checker_sees_every_way_of_importing() -> None:
    planted = (
        "import kvshare.actors.deploy\n"
        "from router import embed\n"
        "def f():\n    from actors.index_client import IndexClient\n"
        "import importlib\nimportlib.import_module('kvshare.router.serve.request_router')\n"
        "__import__('kvshare.actors.config')\n"
        "from kvshare.engines.kv_convert import block_view\n"
    )
    found = imported(planted)
    assert reaches(found, UPPER) == ["kvshare.actors.config", "kvshare.actors.deploy", "actors.index_client",
                                     "actors.index_client.IndexClient", "router",
                                     "kvshare.router.core.embed", "kvshare.router.serve.request_router"]
    assert reaches(found, ("kvshare.engines",)) == ["kvshare.engines.kv_convert",
                                                     "kvshare.engines.kv_convert.block_view"]
    assert reaches(imported("import actorsx\nfrom kvshare.engines_x import y\n"),
                   UPPER + ("kvshare.engines",)) == []


@pytest.mark.parametrize("path", files("kvshare"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_library_never_imports_actors_or_router(path: Path) -> None:
    bad = reaches(imported(path.read_text()), UPPER)
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the library sits below them"


@pytest.mark.parametrize("rel", SDK)
def test_the_sdk_and_vllm_never_import_the_reference_engine(rel: str) -> None:
    bad = reaches(imported((ROOT / rel).read_text()), ("kvshare.engines",))
    assert not bad, f"{rel} imports {bad}: kvshare/engines/ sits on top of the SDK"


def test_nothing_imports_examples() -> None:
    users = [p for folder in ("kvshare", "actors", "router", "tests", "benchmarks", "examples")
             for p in files(folder) if reaches(imported(p.read_text()), ("examples",))]
    assert not users, f"{[str(p.relative_to(ROOT)) for p in users]} import examples/"
