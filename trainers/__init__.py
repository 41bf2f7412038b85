"""The trainer: `train` / `python -m trainers.train` on shard URLs or a manifest, torchrun too.

Modules: `config` (TrainConfig and its flags), `schedule` (batch plan, LR),
`models`, `data` (loaders, overlap check), `distributed`, `loop` (step, epoch,
evaluation), `run` (the Run and its checkpoint round trip), `checkpoint`,
`metrics`, `probe` (find-batch-size, scan-throughput), `train` (main).
"""
