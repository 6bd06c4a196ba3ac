"""py_pytest: a py_test that runs its files under pytest and writes JUnit XML for Bazel."""

def py_pytest(name, srcs, deps = [], data = [], args = [], size = "small", **kwargs):
    native.py_test(
        name = name,
        srcs = srcs + ["//tools/bazel:pytest_main.py"],
        main = "//tools/bazel:pytest_main.py",
        args = args + ["$(rootpath %s)" % src for src in srcs],
        data = data,
        deps = deps + ["@pypi//:pytest"],
        size = size,
        legacy_create_init = False,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )
