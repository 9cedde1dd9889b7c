"""Says which fastpack the tests run against; with ``FASTPACK_EXPECT_INSTALLED=1`` (CI's
wheel run) refuses to run against the source tree."""

from __future__ import annotations

import os
from pathlib import Path

import fastpack

SOURCE = Path(__file__).resolve().parent.parent / "python"


def pytest_report_header() -> str:
    where = Path(fastpack.__file__).resolve()
    if os.environ.get("FASTPACK_EXPECT_INSTALLED") and SOURCE in where.parents:
        raise RuntimeError(f"fastpack is imported from the source tree ({where}), not the wheel")
    return f"fastpack {fastpack.__version__} from {where.parent}"
