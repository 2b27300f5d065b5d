"""``pdserve.v1``: messages and services generated from ``protos/pdserve/v1/*.proto``."""
