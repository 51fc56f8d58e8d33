"""The launch bundle for several machines: what each node runs, and a config that loads there."""

import json
import shlex

import pytest

from studio.cli import main
from studio.core.config import load_config, save_config
from studio.core.errors import StudioError
from studio.core.presets import demo_config
from studio.core.validation import validate


def test_two_host_bundle_has_each_nodes_command_and_a_portable_config(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    config = demo_config().replace(distributed={"sharding": "zero2"})
    save_config(config, source / "run.yaml")
    out = tmp_path / "bundle"
    assert main(["bundle", str(source / "run.yaml"), "--hosts", "10.0.0.1,10.0.0.2", "--gpus-per-host", "4",
                 "--port", "29444", "--out", str(out)]) == 0

    for rank in (0, 1):
        argv = shlex.split((out / f"launch-node-{rank}.sh").read_text().splitlines()[-1].removeprefix("exec "))
        assert f"--node-rank={rank}" in argv and "--nnodes=2" in argv and "--nproc-per-node=4" in argv
        assert "--master-addr=10.0.0.1" in argv and "--master-port=29444" in argv
        assert argv[-3:] == ["config.yaml", "--run-dir", "run"]
        assert f"'--node-rank={rank}'" in (out / f"launch-node-{rank}.ps1").read_text()
        resume = shlex.split((out / f"resume-node-{rank}.sh").read_text().splitlines()[-1].removeprefix("exec "))
        assert resume[:-2] == argv[:-3] and resume[-2:] == ["--resume", "run"]
    assert (out / "hostfile").read_text() == "10.0.0.1 slots=4\n10.0.0.2 slots=4\n"
    assert json.loads((out / "cluster.json").read_text())["world_size"] == 8

    moved = tmp_path / "elsewhere"  # another node: the bundle copied to another path
    (out).rename(moved)
    loaded = load_config(moved / "config.yaml")
    assert validate(loaded) == []
    assert loaded.data.train_files[0].startswith(str(moved)) and loaded.distributed.num_processes == 4
    assert "10.0.0.2: launch-node-1.sh" in (moved / "README.txt").read_text()


def test_plain_data_parallel_needs_no_hostfile_and_a_layer_split_no_bundle(tmp_path):
    from studio.core.run.bundle import write_bundle

    bundle = write_bundle(demo_config(), ("a", "b"), 1, tmp_path / "ddp")
    assert not (bundle.folder / "hostfile").exists()
    with pytest.raises(StudioError, match="one machine"):
        write_bundle(demo_config().replace(distributed={"layer_split": True}), ("a", "b"), 1, tmp_path / "split")


def test_a_pipeline_s_bundle_keeps_each_replica_on_one_machine(tmp_path):
    from studio.core.run.bundle import write_bundle

    piped = demo_config().replace(distributed={"pipeline_stages": 2, "num_processes": 2}, data={"packing": "none"},
                                  schedule={"sample_every": 0})
    assert validate(piped) == []
    with pytest.raises(StudioError, match="2 stages need a multiple of 2 GPUs per machine, not 1") as refused:
        write_bundle(piped, ("a", "b"), 1, tmp_path / "spread")
    assert "give each machine 2 GPUs or a multiple" in refused.value.hint
    bundle = write_bundle(piped, ("a", "b"), 2, tmp_path / "two")
    assert "(4 processes, 2 pipeline replicas of 2 stages, each replica on one machine)" in (
        bundle.folder / "README.txt").read_text()
    assert validate(load_config(bundle.folder / "config.yaml")) == []
