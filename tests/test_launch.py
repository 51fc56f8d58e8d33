"""The commands studio starts, how their results are read, and the distributed section's checks (no processes)."""

import json

import pytest
from helpers import parse_command

from studio.core.errors import StudioError
from studio.core.presets import demo_config
from studio.core.run.commands import (EXIT_ABORTED, EXIT_FAILED, EXIT_OK, EXIT_USAGE, SIMULATION_MODULE, WORKER_MODULE,
                                      Cluster, estimate_simulation_command, export_command, generate_command,
                                      inside_launcher, last_json_object, needs_launcher, read_export_record,
                                      run_handler, simulation_command, torchrun_command, worker_args, worker_command)
from studio.core.validation import validate


def problems_of(**distributed):
    return {p.where: p.message for p in validate(demo_config().replace(distributed=distributed))}


def test_one_machine_uses_a_standalone_rendezvous():
    argv = torchrun_command("python", Cluster(processes_per_machine=2), 0, worker_args("run.yaml", "runs/a"))
    assert argv == ["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                    "-m", "studio.train", "run.yaml", "--run-dir", "runs/a"]


def test_each_machine_gets_its_rank_and_the_main_address():
    cluster = Cluster(num_machines=3, processes_per_machine=8, main_address="10.0.0.1", main_port=29400)
    argv = torchrun_command("python", cluster, 2, worker_args(None, "runs/a", resume=True))
    assert "--node-rank=2" in argv and "--master-addr=10.0.0.1" in argv and "--master-port=29400" in argv
    assert argv[-2:] == ["--resume", "runs/a"] and cluster.world_size == 24


def test_each_command_starts_its_module_and_its_arguments_read_back(tmp_path):
    config, run_dir, out = tmp_path / "run.yaml", tmp_path / "run", tmp_path / "out"
    module, args = parse_command(worker_command("py", worker_args(config, run_dir)))
    assert module == WORKER_MODULE and (args.config, args.run_dir, args.resume) == (config, run_dir, None)
    module, args = parse_command(worker_command("py", worker_args(None, run_dir, resume=True)))
    assert module == WORKER_MODULE and (args.config, args.resume) == (None, run_dir)
    torchrun = torchrun_command("py", Cluster(processes_per_machine=2), 0, worker_args(config, run_dir))
    module, args = parse_command(["py", *torchrun[torchrun.index("-m", 3):]])
    assert module == WORKER_MODULE and (args.config, args.run_dir) == (config, run_dir)
    module, args = parse_command(export_command("py", run_dir, "merged", out, "bfloat16"))
    assert (module, args.command, args.run_dir, args.kind, args.out, args.dtype) == (
        "studio", "export", run_dir, "merged", out, "bfloat16")
    module, args = parse_command(export_command("py", run_dir, "gguf", out, "auto", ("f16", "q4_k_m"), "me/x", True))
    assert (args.kind, args.quant, args.out, args.push_to_hub, args.private) == ("gguf", ["f16", "q4_k_m"], out, "me/x", True)
    for prompt in ('a "quoted" prompt;\nwith lines', "--looks-like-an-option", "-"):
        module, args = parse_command(generate_command("py", run_dir, prompt, 7))
        assert (module, args.command, args.run_dir, args.prompt, args.max_new_tokens, args.json) == (
            "studio", "generate", run_dir, prompt, 7, True)
    module, args = parse_command(estimate_simulation_command("py", config))
    assert (module, args.command, args.config, args.simulate, args.json) == ("studio", "estimate", config, True, True)
    assert simulation_command("py", config) == ["py", "-m", SIMULATION_MODULE, str(config)]  # its parser imports torch


def test_the_last_json_object_is_read_whether_on_one_line_or_indented():
    indented = json.dumps({"peak_bytes": 1, "simulated": {"peak_bytes": 99}}, indent=2)
    assert last_json_object("W1 a library's chatter\n" + indented)["simulated"] == {"peak_bytes": 99}
    assert last_json_object('{"first": 1}\n{"answer": 2}\nexiting\n{broken') == {"answer": 2}
    assert last_json_object("") is None and last_json_object("[1, 2]\nno object") is None


def test_an_export_record_is_read_or_none(tmp_path):
    assert read_export_record(tmp_path) is None
    (tmp_path / "studio_export.json").write_text('{"form": "adapter"}')
    assert read_export_record(tmp_path) == {"form": "adapter"}
    (tmp_path / "studio_export.json").write_text("{torn")
    assert read_export_record(tmp_path) is None


@pytest.mark.parametrize("raised, code", [(StudioError("bad field", "fix it", kind="config"), EXIT_USAGE),
                                          (StudioError("no GPU", kind="model"), EXIT_FAILED),
                                          (KeyboardInterrupt(), EXIT_ABORTED)])
def test_a_failing_command_prints_its_error_and_exits_with_its_code(raised, code, capsys):
    def handler(args):
        raise raised

    assert run_handler(handler, None) == code
    if isinstance(raised, StudioError):
        assert capsys.readouterr().err == f"error: {raised}\n"
    assert run_handler(lambda args: args, EXIT_OK) == EXIT_OK


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
