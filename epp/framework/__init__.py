"""The plugin interfaces (llm-d's ``framework/interface``), below the parts that use them.

* :mod:`~infergate.epp.framework.plugin` — the plugin base class, its context and the
  type-name registry;
* :mod:`~infergate.epp.framework.scheduling` — what the scheduler runs: ``Filter``,
  ``Scorer``, ``Picker``, ``ProfileHandler``, and their ``SchedulingResult``;
* :mod:`~infergate.epp.framework.requestcontrol` — what the Director runs around
  scheduling: ``PrepareData``, ``PreRequest``, ``ResponseHeaders``, ``ResponseComplete``.

One plugin class may implement interfaces of both kinds (the prefix-cache scorer is a
data preparer, a scorer and two hooks). Because the interfaces live here, a plugin in
``scheduling/plugins/`` can implement a request-control hook without ``scheduling``
importing ``requestcontrol``: the Director imports the scheduler, never the reverse.
"""
