"""infergate as a Gateway API implementation (GatewayClass controller ``infergate.io/gateway-controller``).

The pieces, each importing only downward:

* :mod:`infergate.gateway.types`: the seam. What the operator hands the translator (the
  cluster's Gateway API objects, as Kubernetes JSON) and what it gets back (one xDS
  :class:`~infergate.gateway.types.Snapshot` per Gateway, and every status to write).
* :mod:`infergate.gateway.translate`: a pure function from the first to the second,
  with its parts beside it: ``listeners`` (Gateways, listeners, the Envoy listener),
  ``routes`` / ``matches`` / ``filters`` (HTTPRoutes to route tables), ``backends``
  (Services, InferencePools, EPPs: clusters and endpoints), ``hostnames``,
  ``conditions``, ``model`` (defensive reading of JSON bodies), ``options``; and
  ``static`` (a snapshot as a static bootstrap, for ``envoy --mode validate``).
* :mod:`infergate.gateway.xds`: the ADS server Envoy pulls snapshots from.
* :mod:`infergate.operator.gateway.controller`: the kopf handlers that collect the objects, call
  the translator, publish snapshots and apply Deployments, Services and statuses.
"""
