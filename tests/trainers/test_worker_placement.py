"""`train --worker-placement ray` and its config-file keys (issue 30): the flags reach the
train loader's `Workers` exactly, the val loader reads with local workers, a bad value is
one line naming its flag, and several ranks share one cluster or are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pipeline.config import Workers
from shards.cluster import ClusterError
from shards.errors import UsageError
from shards.flags import SettingError, changed_flags
from trainers.config import TrainConfig, parse_command_line
from trainers.data import loader_config
from trainers.distributed import DistInfo
from trainers.metrics import bottleneck_verdict
from trainers.placement import check_room, worker_cluster, workers_text

CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
RAY_FLAGS = [
    "--worker-placement", "ray",
    "--ray-address", "ray://head:10001",
    "--remote-workers", "3",
    "--ray-cpus", "0.5",
    "--ray-resources", '{"cpu_node": 1}',
    "--ray-fallback", "local",
    "--ray-wire", "object_store",
    "--workers", "1",
]  # fmt: skip
EXPECTED = Workers(
    count=1,
    placement="ray",
    ray_address="ray://head:10001",
    remote=3,
    ray_cpus=0.5,
    ray_resources={"cpu_node": 1},
    fallback="local",
    ray_wire="object_store",
)
TOML = """
worker-placement = "ray"
ray-address = "ray://head:10001"
remote-workers = 3
ray-cpus = 0.5
ray-resources = { cpu_node = 1 }
ray-fallback = "local"
ray-wire = "object_store"
workers = 1
"""
YAML = """
worker_placement: ray
ray_address: ray://head:10001
remote_workers: 3
ray_cpus: 0.5
ray_resources: {cpu_node: 1}
ray_fallback: local
ray_wire: object_store
workers: 1
"""


def test_the_placement_flags_reach_the_train_loader_and_the_val_loader_reads_locally():
    _, config = parse_command_line(["--train-shards", "d", *RAY_FLAGS])
    assert config.loader.workers == EXPECTED
    # pin_memory is the one setting the run decides (batches go to a CPU here).
    expected = dataclasses.replace(EXPECTED, pin_memory=False)
    assert loader_config(config, CPU, "train", True).workers == expected
    val = loader_config(config, CPU, "val", False).workers
    assert val == dataclasses.replace(expected, placement="local")
    assert val.count == 1  # --workers: the val loader's local workers


def test_a_stored_config_with_ray_placement_reads_back_the_same():
    """What RUN_DIR/config.json and every checkpoint hold (JSON), read again on resume."""
    _, config = parse_command_line(["--train-shards", "d", *RAY_FLAGS])
    stored = json.loads(json.dumps(config.to_dict()))
    assert stored["loader"]["workers"]["ray_resources"] == {"cpu_node": 1}
    assert TrainConfig.from_dict(stored) == config


@pytest.mark.parametrize("suffix, text", [(".toml", TOML), (".yaml", YAML)])
def test_the_config_file_keys_are_the_flag_names(tmp_path, suffix, text):
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    _, config = parse_command_line(["--train-shards", "d", "--config", str(path)])
    assert config.loader.workers == EXPECTED
    # A flag still wins over the file.
    _, config = parse_command_line(
        ["--train-shards", "d", "--config", str(path), "--remote-workers", "5"]
    )
    assert config.loader.workers == dataclasses.replace(EXPECTED, remote=5)


def test_the_default_is_local_placement_and_ray_address_comes_from_ray_address(monkeypatch):
    _, config = parse_command_line(["--train-shards", "d", "--workers", "2"])
    assert config.loader.workers.placement == "local"
    assert workers_text(config.loader.workers) == "2 workers per rank"
    monkeypatch.setenv("RAY_ADDRESS", "ray://user:secret@head:10001")
    argv = ["--train-shards", "d", "--worker-placement", "ray", "--workers", "0"]
    _, config = parse_command_line(argv)
    assert config.loader.workers.ray_address is None  # RAY_ADDRESS is read where Ray is joined
    assert workers_text(config.loader.workers) == (
        "2 remote roles per rank on ray://***@head:10001 (1 CPU each), 0 local workers"
    )
    monkeypatch.delenv("RAY_ADDRESS")
    assert workers_text(config.loader.workers).startswith(
        "2 remote roles per rank on a Ray started on this machine"
    )


def test_the_start_up_line_and_the_verdict_name_the_placement():
    _, config = parse_command_line(["--train-shards", "d", *RAY_FLAGS])
    assert changed_flags(TrainConfig, config)["workers"] == [
        "--workers 1",
        "--worker-placement ray",
        "--ray-address ray://head:10001",
        "--remote-workers 3",
        "--ray-cpus 0.5",
        '--ray-resources {"cpu_node": 1}',  # as it is typed, not a dict's repr
        "--ray-fallback local",
        "--ray-wire object_store",
    ]
    assert workers_text(EXPECTED) == (
        '3 remote roles per rank on ray://head:10001 (0.5 CPU each, resources {"cpu_node": 1}, '
        "batches through the object store), 1 local workers"
    )
    assert bottleneck_verdict(0.4, 0.1, "cuda", 3, "--remote-workers") == (
        "input-bound: the GPU waited 40% of the time for data; raise --remote-workers (now 3) "
        "or shrink --image-size"
    )


@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["--ray-resources", "{cpu_node: 1}"],
            "argument --ray-resources: '{cpu_node: 1}' is not JSON (Expecting property name",
        ),
        (["--ray-resources", "[1]"], "argument --ray-resources: '[1]' is not a JSON object"),
        (
            ["--worker-placement", "ray", "--ray-resources", '{"cpu_node": "one"}'],
            "--ray-resources amounts must be positive numbers, got 'cpu_node': 'one'",
        ),
        (
            ["--worker-placement", "ray", "--ray-resources", '{"GPU": 1}'],
            "--ray-resources names custom resources, not CPU or GPU",
        ),
        (["--worker-placement", "ray", "--remote-workers", "0"], "--remote-workers must be at"),
        (["--worker-placement", "ray", "--ray-cpus", "-1"], "--ray-cpus must be at least 0"),
        (["--worker-placement", "nodes"], "argument --worker-placement: invalid choice: 'nodes'"),
        (
            ["--remote-workers", "4"],
            "--remote-workers 4 is for --worker-placement ray (worker roles on a Ray cluster), "
            "but the placement is local: add --worker-placement ray, or leave --remote-workers out",
        ),
        (
            ["--ray-resources", '{"cpu_node": 1}'],
            '--ray-resources {"cpu_node": 1} is for --worker-placement ray',
        ),
        (["--ray-address", "ray://u:pw@head:1"], "--ray-address ray://***@head:1 is for"),
        (["--ray-cpus", "2"], "--ray-cpus 2.0 is for --worker-placement ray"),
        (["--ray-fallback", "local"], "--ray-fallback local is for --worker-placement ray"),
        (["--ray-wire", "object_store"], "--ray-wire object_store is for --worker-placement ray"),
        (["--ray-wire", "tcp"], "argument --ray-wire: invalid choice: 'tcp'"),
    ],
)
def test_a_bad_placement_setting_is_one_line_naming_its_flag(capsys, argv, line):
    with pytest.raises(SystemExit) as exit_info:
        parse_command_line(["--train-shards", "d", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train: error: "), err
    assert line in err, err
    assert "pw" not in err


def test_a_config_file_ray_setting_without_ray_placement_names_its_key(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('remote-workers = 4\nray-resources = { cpu_node = "x" }\n')
    with pytest.raises(SystemExit):
        parse_command_line(["--train-shards", "d", "--config", str(path)])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ray-resources amounts must be positive numbers" in err


def test_workers_in_python_refuse_resources_ray_would_refuse():
    with pytest.raises(SettingError, match=r"^Workers.ray_resources names custom resources"):
        Workers(placement="ray", ray_resources={"CPU": 2})
    with pytest.raises(SettingError, match=r"^Workers.ray_resources must be a mapping"):
        Workers(placement="ray", ray_resources=["cpu_node"])
    with pytest.raises(SettingError, match=r"amounts must be positive numbers, got 'a': True"):
        Workers(placement="ray", ray_resources={"a": True})


def test_several_ranks_under_ray_placement_need_one_cluster_they_share(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    started = []  # refused before any Ray is started or joined (whatever ran before)
    monkeypatch.setattr("trainers.placement.start_ray", lambda *args: started.append(args))
    with (
        pytest.raises(UsageError, match=r"with 2 ranks needs one Ray cluster they share: pass "),
        worker_cluster(Workers(placement="ray"), world_size=2),
    ):
        pass
    assert started == []


def test_every_ranks_roles_must_fit_the_cluster_at_once_said_in_flags():
    workers = Workers(placement="ray", remote=2, ray_resources={"cpu_node": 1})
    with pytest.raises(
        ClusterError,
        match=r"^2 ranks each run --remote-workers 2 roles, and the Ray cluster has CPU 3 but .* "
        r"needs CPU 4: add nodes with them, or ask for fewer --remote-workers \(every rank",
    ):
        check_room(workers, 2, {"CPU": 3.0, "cpu_node": 4.0})
    check_room(workers, 2, {"CPU": 4.0, "cpu_node": 4.0})
    with pytest.raises(
        ClusterError,
        match=r"^the Ray cluster has cpu_node 0 but .* needs cpu_node 2: add nodes with them, "
        r"or ask for fewer --remote-workers, or pass --ray-fallback local$",
    ):
        check_room(workers, 1, {"CPU": 4.0})


def test_local_placement_joins_no_cluster():
    with worker_cluster(Workers(count=0), world_size=4):
        pass  # no address needed, nothing started: the ranks' workers are their own
