"""Repository rule: a Python venv built from a lock file, used as the Python toolchain.

The venv lives outside Bazel's output base, in a cache keyed by sha256(`python -VV` + lock), so
every clone of the repository (each has its own output base) reuses the same ~1 GB venv. The
cache folder is $TESSERA_VENV_CACHE, else $HOME/.cache/tessera/venvs. A venv is built under a
temporary name and renamed when complete, so an interrupted build is never taken for a good one.

The generated repository exposes:
  :python_toolchain      the toolchain to register (interpreter = the venv's python)
  :<package>             one empty py_library per locked package (name lower-cased, '-' -> '_'),
                         so each target declares the third-party packages it imports.
"""

def _run(rctx, args, what, timeout = 600):
    result = rctx.execute(args, timeout = timeout, quiet = False)
    if result.return_code != 0:
        fail("python_venv: %s failed (exit %d):\n%s\n%s" % (what, result.return_code, result.stdout, result.stderr))
    return result.stdout

def _locked_packages(lock_text):
    names = []
    for line in lock_text.splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        name = line.split("==")[0].split("[")[0].strip()
        names.append(name.lower().replace("-", "_").replace(".", "_"))
    return names

def _python_venv_impl(rctx):
    python = rctx.os.environ.get("TESSERA_PYTHON") or rctx.which("python3")
    if not python:
        fail("python_venv: no python3 on PATH (set TESSERA_PYTHON to an interpreter)")
    lock_text = rctx.read(rctx.attr.lock)
    version = _run(rctx, [python, "-VV"], "python -VV")

    rctx.file("venv_key_input.txt", version + lock_text)
    key = _run(rctx, ["sha256sum", "venv_key_input.txt"], "sha256sum").split(" ")[0][:20]

    cache = rctx.os.environ.get("TESSERA_VENV_CACHE")
    if not cache:
        home = rctx.os.environ.get("HOME")
        if not home:
            fail("python_venv: set TESSERA_VENV_CACHE or HOME for the venv cache")
        cache = home + "/.cache/tessera/venvs"
    venv = cache + "/" + key

    if not rctx.path(venv + "/bin/python3").exists:
        rctx.report_progress("building Python venv from %s (first time only)" % rctx.attr.lock.name)
        building = venv + ".building"
        _run(rctx, ["mkdir", "-p", cache], "mkdir " + cache)
        _run(rctx, ["rm", "-rf", building], "clean " + building)
        _run(rctx, [python, "-m", "venv", building], "python -m venv")
        # Dependencies are resolved, not skipped: the lock is complete for the CPU build (pip
        # installs exactly its packages), while PyPI's CUDA build of the same torch pin needs
        # its own exactly-pinned nvidia-* libraries and triton, which the lock cannot list.
        _run(
            rctx,
            [building + "/bin/python3", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", str(rctx.path(rctx.attr.lock))],
            "pip install -r " + rctx.attr.lock.name,
            timeout = 3600,
        )
        _run(rctx, ["mv", "-T", building, venv], "rename venv")

    rctx.symlink(rctx.attr.lock, "requirements_lock.txt")
    rctx.file("venv_path.txt", venv + "\n")
    build = [
        'load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")',
        "",
        'exports_files(["requirements_lock.txt", "venv_path.txt"])',
        "",
        "py_runtime(",
        '    name = "runtime",',
        '    interpreter_path = "%s/bin/python3",' % venv,
        '    python_version = "PY3",',
        ")",
        "",
        'py_runtime_pair(name = "runtime_pair", py3_runtime = ":runtime")',
        "",
        "toolchain(",
        '    name = "python_toolchain",',
        '    toolchain = ":runtime_pair",',
        '    toolchain_type = "@bazel_tools//tools/python:toolchain_type",',
        ")",
        "",
    ]
    for name in _locked_packages(lock_text):
        build.append('py_library(name = "%s", visibility = ["//visibility:public"])' % name)
    rctx.file("BUILD.bazel", "\n".join(build) + "\n")

python_venv = repository_rule(
    implementation = _python_venv_impl,
    attrs = {
        "lock": attr.label(mandatory = True, allow_single_file = True),
    },
    environ = ["TESSERA_VENV_CACHE", "TESSERA_PYTHON", "HOME"],
)
