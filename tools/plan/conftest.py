"""Outside Bazel (plain pytest), the planner's dependency tools/estimate is not on the path that
the estimate_lib target's `imports` gives it under Bazel."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "estimate"))
