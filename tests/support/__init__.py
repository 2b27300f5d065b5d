"""What several test directories share: a fake node, node flags, process helpers.

Importable as ``support`` (pytest's ``pythonpath`` puts ``tests/`` on the path).
"""
