"""Request control (GIE's ``requestcontrol``): the director and the hooks it runs.

Body parsing, model rewrite, objectives and priority, admission, candidate selection,
then one scheduling cycle (data preparers, the scheduler, pre-request hooks); the
response hooks and the response-side accounting run back through the director. It sits
above scheduling: it imports the scheduler, and the hook interfaces it runs live below
both, in :mod:`infergate.epp.framework.requestcontrol`.
"""
