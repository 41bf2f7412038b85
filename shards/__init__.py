"""The on-disk shard contract shared by `preprocess` (writer) and `pipeline` (reader).

Imports neither torch nor ray, so Ray workers and tests stay light.
"""
