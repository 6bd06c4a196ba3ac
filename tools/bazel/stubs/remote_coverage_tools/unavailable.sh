#!/bin/sh
echo "coverage tools are not available offline: 'bazel coverage' is unsupported here" >&2
exit 1
