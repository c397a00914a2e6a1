"""The data layer (GIE's ``datalayer``): what the EPP knows about endpoints.

Endpoint discovery feeds (``discovery/``), the datastore of live endpoints, the store of
InferenceObjectives and InferenceModelRewrites (``objectives.py``, fed by the same
discovery), per-endpoint metrics collectors and their Prometheus dialects, KV-event and
completion-record subscriptions.
"""
