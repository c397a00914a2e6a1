"""Request control (GIE's ``requestcontrol``): the director and its hooks.

Body parsing, model rewrite, objectives and priority, admission, candidate selection,
then scheduling; response-side accounting runs back through the director.
"""
