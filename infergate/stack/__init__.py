"""The local stack: engines, one Endpoint Picker and one real Envoy on loopback."""
