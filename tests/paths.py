"""Where things are, for tests in any folder under tests/: the repository, this folder (the
helper modules' home, which a test's subprocess puts on its ``sys.path``) and the shared
traces beside the checkout."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TRACES = ROOT.parent / "shared" / "traces"
