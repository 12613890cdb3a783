"""Packaging glue that pyproject.toml cannot say: the repository root is the package
``splitserve`` (pyproject.toml's package-dir), so its subpackages are found here, every
folder with an ``__init__.py`` but tests/, and named under it; and this file, which sits
in that root, is kept out of the package. Everything else about the distribution
(metadata, dependencies, package data) is in pyproject.toml."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SUBPACKAGES = find_packages(str(HERE), exclude=("tests", "tests.*"))


class BuildPy(build_py):
    """build_py without ``splitserve.setup`` (this file)."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("splitserve", Path(__file__).stem)]


setup(packages=["splitserve", *(f"splitserve.{name}" for name in SUBPACKAGES)], cmdclass={"build_py": BuildPy})
