"""The docs site: the configuration reference is generated, the site builds strictly, and the
README stays short with links that land on pages that exist."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_reference",
                                                  DOCS / "gen_config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_configuration_reference_is_what_the_dataclasses_generate() -> None:
    gen = _generator()
    committed = gen.OUTPUT.read_text()
    assert committed == gen.render(), (
        "docs/reference/configuration.md is stale: run `python docs/gen_config_reference.py` "
        "(or `make docs`) and commit the result")


def test_every_settings_field_has_a_doc() -> None:
    classes = _generator().settings_classes()
    assert {cls.__name__ for cls, _ in classes} == {
        "ConnectorSettings", "PoolSettings", "NamespaceSpec", "IndexConfig",
        "ServeRouterSettings", "StorageSettings"}
    missing = [f"{cls.__name__}.{f.name}" for cls, _ in classes
               for f in dataclasses.fields(cls)
               if not _generator().field_docs(cls).get(f.name, "").strip()]
    assert not missing, f"give these fields a docstring (the string right after them): {missing}"


def test_mkdocs_builds_strictly(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed (the `test` extra has them)")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").exists()
    shutil.rmtree(tmp_path / "site")


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_short_and_its_docs_links_exist() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300, "README.md is a front page: move detail into docs/"
    links = [m.group(1) for m in _LINK.finditer(text)]
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+:", link)]
    docs_links = [link for link in local if link.startswith("docs/")]
    assert docs_links, "README.md should link into docs/"
    missing = [link for link in local if link and not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
