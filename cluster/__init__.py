"""Joining a Ray cluster, for the offline build (`preprocess/`) and the loader's remote
roles (`pipeline/`) alike.

Its own floor, between `shards` and the two packages that use it: `shards` may not
import Ray (Ray workers and quick tests stay light), and `preprocess` and `pipeline`
may not import each other, so the one start-up both need lives here. It imports Ray
and `shards` (errors, redaction) only.
"""
