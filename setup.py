"""Maps the top-level component folders under the single import root ``infergate``.

The folders ``engine/``, ``epp/`` and ``operator/`` sit at the top of the repository so the
layout shows the architecture, but they import as ``infergate.engine`` and so on.
``operator`` is special: a regular package of that name at the repository root would
shadow the standard library's ``operator`` for any ``python -m …`` started there. So
``operator/`` has no ``__init__.py`` and reaches ``infergate.operator`` through the
symlink ``infergate/operator -> ../operator`` (see operator/README.md).
"""

from setuptools import find_namespace_packages, setup
from setuptools_rust import Binding, RustExtension

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

# The EPP's HTTP/2 framing for gRPC (native/grpc_h2, the h2 crate through PyO3): built by
# cargo (Rust >= 1.85) at install time, an abi3 module for every CPython from 3.11.
# Optional: an install without cargo (the engine and operator images) still works, and an
# EPP without the module serves ext-proc with grpc.aio, saying so.
NATIVE = RustExtension(
    "infergate.epp._grpc_h2",
    path="native/grpc_h2/Cargo.toml",
    binding=Binding.PyO3,
    py_limited_api=True,
    debug=False,  # release even for an editable install (setuptools-rust's default is debug)
    optional=True,
)

# The prefix-cache scorer's index and block hashing (native/prefix_index): optional the
# same way; without it the scorer uses its Python index (same results, more CPU).
PREFIX_INDEX = RustExtension(
    "infergate.epp.scheduling._prefix_index",
    path="native/prefix_index/Cargo.toml",
    binding=Binding.PyO3,
    py_limited_api=True,
    debug=False,
    optional=True,
)

setup(
    packages=packages,
    package_dir=ROOTS,
    rust_extensions=[NATIVE, PREFIX_INDEX],
    zip_safe=False,
)
