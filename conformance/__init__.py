"""infergate's InferencePool conformance suite (see conformance/README.md)."""
