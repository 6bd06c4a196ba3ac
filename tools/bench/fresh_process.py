"""A bench case run in a process of its own, so each case's peak memory, allocator state and
compile caches start clean and one failing case does not end the comparison."""

from __future__ import annotations

import json
import subprocess
import sys


def run_in_fresh_process(script: str, args: list[str], label: str, env: dict | None = None) -> dict | None:
    """Runs `python script *args`, returns the JSON object its last stdout line holds; on failure
    prints one line naming `label` and the child's last stderr line, and returns None."""
    child = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env)
    if child.returncode:
        err = child.stderr.strip()
        print(f"{label} failed: {err.splitlines()[-1] if err else f'exit {child.returncode}'}", flush=True)
        return None
    return json.loads(child.stdout.strip().splitlines()[-1])
