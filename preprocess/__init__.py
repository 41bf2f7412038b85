"""The offline half: image files or a list file in, tar and Parquet shards plus a manifest out.

First in the flow (`preprocess -> shards <- pipeline <- trainers`): it writes the on-disk
contract of `shards` and imports neither `pipeline` nor `trainers`, so a build needs no torch.
Modules: `cli` (`make-sample`, `build-shards`, `verify`, `info`, `index`), `config`
(BuildConfig), `sources` (listing), `plan`, `job` (the driver), `output` (the build
record), `pool` and `ray_job` (executors), `build` (one shard task), `images`, `sizing`,
`progress`, `commit` (errors, manifest, client files), `dry_run`, `verify`, `sample`.
"""
