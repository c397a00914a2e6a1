"""The Gateway API controller (GatewayClass ``infergate.io/gateway-controller``).

* :mod:`.controller`: the kopf wiring, loaded by ``infergate operator`` as a kopf module;
  one debounced loop over everything the watches have seen.
* :mod:`.objects`: each Gateway's proxy objects (ConfigMap, Deployment, Service), pure.
* :mod:`.sync`: applies those objects and the statuses, only when they changed.
* :mod:`.status`: stamps the statuses the translator computed.
* :mod:`.xds`: the ADS server the proxies connect to, and their bootstrap.

Imports go controller → sync → objects/status/xds; the pure translation lives in
:mod:`infergate.gateway`, which imports nothing of the operator.
"""
