"""Prints 'tests: N passed, N failed, N skipped' over every test.xml under Bazel's testlogs.

Exits 1 when no test case ran at all, so an empty suite never looks green.
"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(testlogs: str) -> int:
    passed = failed = skipped = 0
    for xml in Path(testlogs).rglob("test.xml"):
        for case in ET.parse(xml).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")
    return 0 if passed + failed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bazel-testlogs"))
