"""Shared pieces of every library's BUILD file."""

def library_package_files():
    """`:package_files`: what `pip install ./libs/<name>` packages (code, assets, pyproject, README);
    the root tests install it alone and scan its imports."""
    native.filegroup(
        name = "package_files",
        srcs = native.glob(["tessera/**"]) + ["pyproject.toml", "README.md"],
        visibility = ["//tests:__pkg__"],
    )

    # the library's version, read by the trainer's --version
    native.exports_files(["pyproject.toml"], visibility = ["//visibility:public"])
