"""pdserve's protobuf contract, generated from ``protos/`` by ``make protos`` (build output).

Only this file and ``v1/__init__.py`` are committed, so that the package exists when the project
is installed; the ``*_pb2*.py`` modules beside them are generated and git-ignored.
"""
