"""The kopf operator for InferencePool (imports as ``infergate.operator``, never ``operator``)."""
