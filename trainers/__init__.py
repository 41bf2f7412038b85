"""The trainer: `train` / `python -m trainers.train` on shard URLs or a manifest, torchrun too.

Last in the flow (`preprocess -> shards <- pipeline <- trainers`): it reads shards through
`pipeline` and the `shards` contract, never `preprocess`, so training needs no build code.
Modules: `config` (TrainConfig and its flags), `schedule` (batch plan, LR),
`models`, `numerics` (determinism, autocast dtype, optimizer), `data` (loaders,
overlap check), `distributed`, `loop` (step, epoch, evaluation), `run` (the Run and
its checkpoint round trip), `checkpoint`, `metrics`, `probe` (find-batch-size,
scan-throughput), `train` (main).
"""
