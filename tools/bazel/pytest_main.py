"""Entry point of every py_pytest target: runs pytest on the files given as arguments."""

import os
import sys

import pytest


def main() -> int:
    args = ["-q", "-p", "no:cacheprovider", "--import-mode=importlib", *sys.argv[1:]]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append("--junitxml=" + xml)
    return pytest.main(args)


if __name__ == "__main__":
    sys.exit(main())
