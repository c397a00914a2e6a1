"""The data layer (GIE's ``datalayer``): what the EPP knows about endpoints.

Endpoint discovery feeds (``discovery/``), the datastore of live endpoints, per-endpoint
metrics collectors and their Prometheus dialects, and KV-event subscriptions.
"""
