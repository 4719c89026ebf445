"""Installed, the project is one import name: the wheel ``pip install .`` would install holds
the package ``kvshare`` (with ``kvshare.actors``, ``kvshare.router`` and the live page's HTML)
and nothing else at the top level, and every console entry point names a ``kvshare`` module."""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

from paths import ROOT


def test_the_wheel_installs_only_kvshare(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("kvshare-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = z.read(info).decode()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvshare"}, f"top-level names besides kvshare: {sorted(tops - {'kvshare'})}"
    for package in ("kvshare/actors/deploy.py", "kvshare/router/serve/__init__.py",
                    "kvshare/router/web/page.html", "kvshare/configs/Llama-3.1-8B.json"):
        assert package in names, f"{package} is missing from the wheel"
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    targets = [v for section in parser.sections() for v in parser[section].values()]
    assert targets and all(t.startswith("kvshare.") for t in targets), targets
