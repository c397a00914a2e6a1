"""The Endpoint Picker: an Envoy ext-proc server (imports as ``infergate.epp``)."""
