"""torchft's Lighthouse, started without importing torch: `python .../tessera/trainer/lighthouse.py
[torchft_lighthouse's options]` (`command()`).

The wheel's `torchft_lighthouse` script imports `torchft`, whose package __init__ imports torch
(1.5 s of CPU and its memory for a process that never touches a tensor). The server is the Rust
extension's `lighthouse_main` (the script's own entry point), so this loads that extension from
the package's folder without running the package's __init__. The extension parses the process's
own arguments after the first, as for the script: so this file runs by its path (not `-m`), and
imports only modules Python has loaded before it runs (its folder, first on sys.path, holds the
trainer's modules).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def command() -> list[str]:
    """The command that starts the Lighthouse with this interpreter (the job plan made sure it has torchft)."""
    return [sys.executable, os.path.abspath(__file__)]


def main() -> int:
    folder = importlib.util.find_spec("torchft").submodule_search_locations[0]  # found, not imported
    extension = next(path for suffix in importlib.machinery.EXTENSION_SUFFIXES
                     if os.path.isfile(path := os.path.join(folder, f"_torchft{suffix}")))
    spec = importlib.util.spec_from_file_location("torchft._torchft", extension)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.lighthouse_main()


if __name__ == "__main__":
    sys.exit(main())
