"""pytest plugin (registered by entry point ``pytest11``): fixtures for real prompt/decoder pairs.

Placeholder: the fixtures are built in ``aiodatadist.testing``; see the docs.
"""
