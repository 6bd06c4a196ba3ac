"""Entry point of every py_pytest target: runs pytest on the files given as arguments, and
takes Bazel's test sharding (a target's shard_count) when it is set."""

import os
import sys
from pathlib import Path

import pytest


class BazelShard:
    """Keeps this shard's share of the tests: every TEST_TOTAL_SHARDS-th test function from
    TEST_SHARD_INDEX on, in file order, each function with all its parametrizations (they tend to
    share a module's fixtures, which a split would build twice)."""

    def __init__(self, index: int, total: int) -> None:
        self.index, self.total = index, total

    def pytest_collection_modifyitems(self, config, items) -> None:
        functions = list(dict.fromkeys(item.nodeid.split("[")[0] for item in items))
        mine = {f for i, f in enumerate(functions) if i % self.total == self.index}
        kept = [item for item in items if item.nodeid.split("[")[0] in mine]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid.split("[")[0] not in mine])
        items[:] = kept


def main() -> int:
    args = ["-q", "-p", "no:cacheprovider", "--import-mode=importlib", *sys.argv[1:]]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append("--junitxml=" + xml)
    plugins = []
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total > 1:
        Path(os.environ["TEST_SHARD_STATUS_FILE"]).touch()  # tells Bazel this runner shards
        plugins.append(BazelShard(int(os.environ["TEST_SHARD_INDEX"]), total))
    return pytest.main(args, plugins=plugins)


if __name__ == "__main__":
    sys.exit(main())
