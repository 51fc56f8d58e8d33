"""Launch commands and the distributed section's checks (pure Python, no processes)."""

from studio.core.launch import Cluster, inside_launcher, needs_launcher, torchrun_argv, worker_args
from studio.core.presets import demo_config
from studio.core.validation import validate


def problems_of(**distributed):
    return {p.where: p.message for p in validate(demo_config().replace(distributed=distributed))}


def test_one_machine_uses_a_standalone_rendezvous():
    argv = torchrun_argv(Cluster(processes_per_machine=2), 0, worker_args("run.yaml", "runs/a"), python="python")
    assert argv == ["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                    "-m", "studio.train", "run.yaml", "--run-dir", "runs/a"]


def test_each_machine_gets_its_rank_and_the_main_address():
    cluster = Cluster(num_machines=3, processes_per_machine=8, main_address="10.0.0.1", main_port=29400)
    argv = torchrun_argv(cluster, 2, worker_args(None, "runs/a", resume=True), python="python")
    assert "--node-rank=2" in argv and "--master-addr=10.0.0.1" in argv and "--master-port=29400" in argv
    assert argv[-2:] == ["--resume", "runs/a"] and cluster.world_size == 24


def test_a_process_started_by_torchrun_does_not_launch_again():
    env = {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    assert inside_launcher(env) and not needs_launcher(2, env)
    assert needs_launcher(2, {}) and not needs_launcher(1, {})


def test_offload_and_layer_split_combinations_are_explained():
    assert "distributed.offload_optimizer" in problems_of(offload_optimizer="cpu")
    assert "distributed.offload_params" in problems_of(sharding="zero2", offload_params="cpu")
    assert "distributed.nvme_path" in problems_of(sharding="zero3", offload_params="nvme")
    assert "distributed.layer_split" in problems_of(layer_split=True, num_processes=2)
    assert problems_of(sharding="zero3", offload_optimizer="cpu", offload_params="cpu", num_processes=2) == {}
