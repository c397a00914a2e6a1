"""Maps the top-level component folders under the single import root ``infergate``.

The folders ``operator/``, ``epp/`` and ``engine/`` sit at the top of the repository so
the layout shows the architecture, but they import as ``infergate.operator`` and so on:
``operator`` on its own is the standard library's module and must never be shadowed.
"""

from setuptools import find_packages, setup

ROOTS = {
    "infergate": "infergate",
    "infergate.operator": "operator",
    "infergate.epp": "epp",
    "infergate.engine": "engine",
}

packages: list[str] = []
for package, folder in ROOTS.items():
    packages.append(package)
    packages.extend(f"{package}.{sub}" for sub in find_packages(folder))

setup(packages=packages, package_dir=ROOTS)
