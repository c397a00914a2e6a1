"""infergate: an inference-aware gateway for Kubernetes.

Components live in top-level folders and import under this root:
``infergate.engine`` (engine/), ``infergate.epp`` (epp/), ``infergate.operator`` (operator/).
"""

__version__ = "0.1.0"
