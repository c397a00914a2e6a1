"""Scheduling (GIE's ``scheduling``): profiles → filters → weighted scorers → picker.

The plugins live in ``plugins/``, registered by GIE's type names.
"""
