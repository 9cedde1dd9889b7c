"""Says which fastpack the tests run against; with ``FASTPACK_EXPECT_INSTALLED=1`` (CI's
wheel run) refuses to run against the source tree."""

from __future__ import annotations

import os
from pathlib import Path

import fastpack

try:
    from hypothesis import settings
except ImportError:  # the base installs run without hypothesis; its tests skip themselves
    settings = None

if settings is not None:
    # CI draws the same examples on every run (`.ci/run` sets HYPOTHESIS_PROFILE=ci), so a
    # red run is a reproducible one; `explore` draws new, many more, for a long local run.
    settings.register_profile("ci", derandomize=True, database=None)
    settings.register_profile("explore", max_examples=2000, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

SOURCE = Path(__file__).resolve().parent.parent / "python"


def pytest_report_header() -> str:
    where = Path(fastpack.__file__).resolve()
    if os.environ.get("FASTPACK_EXPECT_INSTALLED") and SOURCE in where.parents:
        raise RuntimeError(f"fastpack is imported from the source tree ({where}), not the wheel")
    # A build from before the abi3 switch left `_core.cpython-3XX-*.so` next to the new
    # `_core.abi3.so`; Python prefers the old one, so the tests would run stale code.
    builds = sorted(p.name for p in where.parent.glob("_core.*.so"))
    if len(builds) > 1:
        raise RuntimeError(f"several builds of fastpack._core in {where.parent}: {builds}; "
                           "delete all but the newest (`pip install -e .` writes _core.abi3.so)")
    return f"fastpack {fastpack.__version__} from {where.parent}"
