"""Maps the top-level component folders under the single import root ``infergate``.

The folders ``engine/``, ``epp/`` and ``operator/`` sit at the top of the repository so the
layout shows the architecture, but they import as ``infergate.engine`` and so on.
``operator`` is special: a regular package of that name at the repository root would
shadow the standard library's ``operator`` for any ``python -m …`` started there. So
``operator/`` has no ``__init__.py`` and reaches ``infergate.operator`` through the
symlink ``infergate/operator -> ../operator`` (see operator/README.md).
"""

from setuptools import find_namespace_packages, setup

ROOTS = {
    "infergate": "infergate",
    "infergate.epp": "epp",
    "infergate.engine": "engine",
}

packages: list[str] = []
for package, folder in ROOTS.items():
    packages.append(package)
    subs = find_namespace_packages(folder, exclude=["*__pycache__*"])
    packages.extend(f"{package}.{sub}" for sub in subs)

setup(packages=packages, package_dir=ROOTS)
