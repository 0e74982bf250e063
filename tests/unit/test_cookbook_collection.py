"""Without the ``cookbook`` extra (nbformat, nbclient), the cookbook's notebook tests are skipped
rather than stopping the whole test run at collection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK_TESTS = "tests/integration/test_cookbook.py"
# A cheap test run beside it: the run must go on past the cookbook file and pass.
OTHER_TEST = "tests/unit/runtime/test_loading.py::test_cache_dir_follows_the_environment"
# A child pytest in which importing the named module fails as if it were not installed.
RUN_WITHOUT = ("import sys; sys.modules[{module!r}] = None; import pytest; "
               "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', {paths}]))")


@pytest.mark.parametrize("module", ["nbformat", "nbclient"])
def test_the_cookbook_tests_are_skipped_without_the_cookbook_extra(module):
    paths = f"{COOKBOOK_TESTS!r}, {OTHER_TEST!r}"
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT.format(module=module, paths=paths)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"collecting the cookbook tests without {module} failed (exit {done.returncode}):\n{out}"
    assert "1 passed, 1 skipped" in out and "cookbook extra is not installed" in out, out
    assert "error" not in out.lower().replace("errors=", ""), out
