"""The ``studio`` command. Each subcommand imports the ML stack only when it runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from studio.cli_memory import add_estimate, add_fit
from studio.core.errors import StudioError
from studio.core.export.gguf import DEFAULT_QUANT, QUANT_TYPES
from studio.core.run.commands import run_handler
from studio.train import entry as train_entry


def _add_train(commands) -> None:
    p = commands.add_parser("train", help=train_entry.HELP, description=train_entry.DESCRIPTION)
    train_entry.add_arguments(p)
    p.set_defaults(handler=train_entry.train)


def _add_demo(commands) -> None:
    p = commands.add_parser("demo", help="fine-tune the embedded tiny model and show before/after accuracy",
                            description="Fine-tune the embedded tiny model with LoRA on a task it fails, "
                                        "report held-out accuracy before and after, and export the adapter. No network or GPU needed.")
    p.add_argument("--run-dir", type=Path, help="where the run goes")
    demo = p.add_mutually_exclusive_group()
    demo.add_argument("--objective", choices=("sft", "dpo", "grpo"), default="sft",
                      help="sft (default): learn to answer; dpo: learn to prefer a style of answer from preference "
                           "pairs, reporting the preference accuracy on held-out pairs before and after; grpo: learn a "
                           "format from prompts and a reward alone, reporting the held-out prompts' reward before and "
                           "after")
    demo.add_argument("--vision", action="store_true",
                      help="the vision demo: the tiny vision-language model learns to name the colour of drawn "
                           "shapes, reporting the exact match on held-out drawings before and after")
    p.set_defaults(handler=_demo)


def _add_export(commands) -> None:
    p = commands.add_parser("export", help="export a run's adapter or merged model, verified",
                            description="Export the newest checkpoint of a run and verify it by reloading and comparing logits.")
    p.add_argument("run_dir", type=Path)
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--adapter", action="store_const", const="adapter", dest="kind", help="the LoRA adapter (PEFT format)")
    kind.add_argument("--merged", action="store_const", const="merged", dest="kind", help="a full model with the adapter merged in")
    kind.add_argument("--gguf", action="store_const", const="gguf", dest="kind",
                      help="GGUF files for llama.cpp, Ollama and LM Studio (each with an Ollama Modelfile), converted by "
                           "llama.cpp's converter")
    p.add_argument("--quant", nargs="+", choices=QUANT_TYPES, default=[DEFAULT_QUANT],
                   help=f"GGUF types to write (default {DEFAULT_QUANT}); q4_k_m needs llama-cpp-python")
    p.add_argument("--check", action="store_true", help="with --gguf: only check, in seconds, that llama.cpp can "
                   "convert the run's model and tokenizer (what the export checks before any work); writes nothing")
    p.add_argument("--out", type=Path, help="destination folder (default: RUN_DIR/exports/KIND)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weights dtype of a merged export")
    p.add_argument("--push-to-hub", metavar="OWNER/NAME", help="then publish the export to this Hugging Face Hub "
                   "repository (created if needed), with your saved Hub login or HF_TOKEN")
    p.add_argument("--private", action="store_true", help="create the Hub repository private")
    p.set_defaults(handler=_export)


def _add_generate(commands) -> None:
    p = commands.add_parser("generate", help="answer a prompt with the base and the fine-tuned model",
                            description="Answer a prompt with the run's base model and with its newest checkpoint, side by side.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--image", type=Path, help="an image file the prompt asks about (a vision-language run)")
    p.add_argument("--json", action="store_true", help="print one JSON object: base, tuned, checkpoint")
    p.set_defaults(handler=_generate)


def _add_eval(commands) -> None:
    p = commands.add_parser("eval", help="compare the base and the fine-tuned model on held-out rows",
                            description="Score the run's base model and its newest checkpoint on held-out rows: loss "
                            "and perplexity over completion tokens, and for rows with a reference answer exact match, "
                            "contains and token F1 of greedy answers; for a preference run, held-out pairs ranked as "
                            "its objective ranks them: the preference accuracy and the mean margin; for a grpo run, "
                            "held-out prompts answered greedily (deterministic) and scored by the run's own rewards: "
                            "each function's mean, the weighted total and the share of prompts given every reward. "
                            "Writes RUN_DIR/evaluation.json (every row, worst first) and an event the model card shows.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--data", nargs="+", metavar="FILE", help="rows to evaluate on (default: the run's eval_files, "
                   "else the rows its eval_fraction held out)")
    p.add_argument("--max-new-tokens", type=int, help="the longest answer generated (default 256, each batch "
                   "stopping 16 tokens past its longest reference; a grpo run: its grpo.max_completion_length)")
    p.add_argument("--tasks", nargs="+", metavar="TASK", help="instead: lm-evaluation-harness tasks (hellaswag, "
                   "arc_easy, mmlu, ... or your own), base vs fine-tuned; writes RUN_DIR/benchmarks.json. Needs "
                   'pip install "finetune-studio[lm-eval]" and the tasks\' datasets in the Hugging Face cache')
    p.add_argument("--include-path", type=Path, metavar="FOLDER", help="with --tasks: a folder of task YAML files "
                   "of your own (a task over local files)")
    p.add_argument("--limit", type=int, help="with --tasks: at most this many examples per task (a quick look)")
    p.add_argument("--json", action="store_true", help="print the whole result as one JSON object")
    p.set_defaults(handler=_eval)


def _add_track(commands) -> None:
    from studio.core.config import choice_values

    p = commands.add_parser("track", help="send a run's figures to TensorBoard or a tracker again, from its events",
                            description="Feed RUN_DIR/events.jsonl to a tracker: by default write RUN_DIR/tensorboard "
                            "anew (for a run trained without schedule.tensorboard, or whose files were deleted); with "
                            "--to trackio, wandb or mlflow add the whole run to that tracker's run named after "
                            "RUN_DIR (for a run trained without it, or while it could not be reached), with the "
                            "tracker's own login and schedule.tracker_project of the run's config.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--to", nargs="+", choices=("tensorboard", *choice_values("schedule.trackers")),
                   default=["tensorboard"], metavar="TRACKER",
                   help="tensorboard (the default), trackio, wandb or mlflow; several are fed one after the other")
    p.set_defaults(handler=_track)


def _add_config(commands) -> None:
    from studio.core.config import reference_markdown

    p = commands.add_parser("config", help="write, check or document run configs",
                            description="Write a starter config, check one, or print the field reference.",
                            epilog=reference_markdown(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["init", "check", "reference"])
    p.add_argument("file", nargs="?", type=Path, help="the config file (init writes it, check reads it)")
    p.add_argument("--vision", action="store_true", help="init: the vision demo's run (`studio demo --vision`)")
    p.set_defaults(handler=_config)


def _add_bundle(commands) -> None:
    p = commands.add_parser("bundle", help="write the launch bundle of a run on several machines",
                            description="Write a folder to copy to every machine: the run config with its data, "
                                        "a DeepSpeed hostfile for ZeRO, and the torchrun command of each machine "
                                        "(launch-node-RANK.sh / .ps1), with a README.txt saying what goes where.")
    p.add_argument("config", type=Path, help="the run config (YAML)")
    p.add_argument("--hosts", required=True, help="the machines' addresses, comma-separated; the first is the main node")
    p.add_argument("--gpus-per-host", type=int, required=True, help="GPUs (processes) on each machine")
    p.add_argument("--port", type=int, default=29500, help="the main node's rendezvous port (default 29500)")
    p.add_argument("--out", type=Path, help="the folder to write (default: NAME-bundle beside the config)")
    p.set_defaults(handler=_bundle)


def _add_doctor(commands) -> None:
    p = commands.add_parser("doctor", help="check every technique on this machine's GPU and measure its CUDA overheads",
                            description="Train a few steps of a small model with each technique (LoRA in fp32, bf16 "
                                        "and fp16, QLoRA, 8-bit AdamW, the memory savers, torch.compile) on the GPU "
                                        "and again on the CPU, compare the losses, measure the CUDA context and the "
                                        "allocator's margin and keep them as this machine's calibration for the "
                                        "memory estimate. Without a GPU the checks run on the CPU. Writes a report "
                                        "to attach to a bug report.")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--out", type=Path, help="the report (Markdown; its JSON goes beside it) (default: a new file in "
                                            "the self-test folder of the user's data folder)")
    p.add_argument("--only", default="", help="comma-separated technique names (default: all)")
    p.set_defaults(handler=_doctor)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="studio", description="Finetune Studio: fine-tune language models on your own GPU.")
    commands = parser.add_subparsers(dest="command")
    for add in (_add_train, _add_demo, _add_export, _add_generate, _add_eval, _add_track, add_estimate, add_fit, _add_config, _add_bundle,
                _add_doctor):
        add(commands)
    return parser


def _demo(args) -> int:
    from studio.train.demo import run_demo

    return run_demo(args.run_dir, "vision" if args.vision else args.objective)


def _export(args) -> int:
    from studio.core.export.publishing import check_can_push
    from studio.core.run.commands import read_export_record
    from studio.train.export.hf_format import export_run
    from studio.train.export.hub_push import publish

    if args.private and not args.push_to_hub:
        raise StudioError("--private makes a Hub repository private", "add --push-to-hub OWNER/NAME", kind="usage")
    if args.check:
        return _check_gguf(args)
    if args.push_to_hub:
        check_can_push(args.push_to_hub)  # before minutes of export work
    if args.kind == "gguf":
        out = _export_gguf(args)
    else:
        out, verification = export_run(args.run_dir, args.kind, args.out, args.dtype)
        print(f"exported {args.kind} to {out}")
        print(f"form: {read_export_record(out).get('form')}")
        print(f"verified: max logit difference {verification.max_abs_diff:.3g}, "
              f"top-1 agreement {verification.top1_agreement:.1%} on {verification.samples} samples")
    if args.push_to_hub:
        print(f"published: {publish(args.run_dir, out, args.push_to_hub, args.private)}")
    return 0


def _check_gguf(args) -> int:
    from studio.train.export.gguf import check_gguf

    if args.kind != "gguf" or args.push_to_hub:
        raise StudioError("--check checks a GGUF export before it starts", "use it as `studio export RUN --gguf "
                          "--check`, without --push-to-hub", kind="usage")
    _, config, _, converter = check_gguf(args.run_dir, tuple(args.quant))
    print(f"GGUF can be made: llama.cpp's converter ({converter.source}) converts {config.model.name_or_path} "
          "and its tokenizer")
    return 0


def _export_gguf(args) -> Path:
    from studio.core.run.commands import read_export_record
    from studio.train.export.gguf import export_gguf

    out, _ = export_gguf(args.run_dir, tuple(args.quant), args.out)
    print(f"exported GGUF to {out}")
    for quant, file in read_export_record(out)["files"].items():
        check = file["verification"]
        print(f"  {file['file']}: {file['bytes'] / 1e6:.1f} MB, same next token as the merged model "
              f"{check['top1_agreement']:.1%} of the time on {check['samples']} held-out samples "
              f"(max logit difference {check['max_abs_diff']:.3g}); Ollama: cd {out} && ollama create NAME -f "
              f"{file['modelfile']['file']}")
        if file["modelfile"].get("note"):
            print(f"    Modelfile: {file['modelfile']['note']}")
    return out


def _generate(args) -> int:
    import json

    from studio.train.evaluation.generate import side_by_side

    answers = side_by_side(args.run_dir, args.prompt, args.max_new_tokens, args.image)
    if args.json:
        print(json.dumps(answers))
    else:
        print(f"base:       {answers['base']}\nfine-tuned: {answers['tuned']}  ({answers['checkpoint']})")
    return 0


def _eval(args) -> int:
    import json

    from studio.core.run.evaluation import benchmark_rows, comparison_lines
    from studio.train.evaluation.benchmarks import benchmark_run
    from studio.train.evaluation.compare import evaluate_run

    if args.tasks:
        result = benchmark_run(args.run_dir, args.tasks, args.include_path, args.limit)
        lines = [f"{'task':24}{'metric':16}{'base':>10}{'fine-tuned':>12}"]
        lines += [f"{task:24}{metric:16}{base:>10}{tuned:>12}" for task, metric, base, tuned in benchmark_rows(result)]
    else:
        result = evaluate_run(args.run_dir, tuple(args.data or ()), args.max_new_tokens)
        lines = comparison_lines(result, args.run_dir)
    print(json.dumps(result, ensure_ascii=False) if args.json else "\n".join(lines))
    return 0


def _track(args) -> int:
    from studio.core.run.directory import RunDir
    from studio.train.tracking.writer import replay

    if not RunDir(args.run_dir).events.is_file():
        raise StudioError(f"{args.run_dir} has no events.jsonl", "pick a run directory (it holds config.yaml and "
                          "events.jsonl)", kind="usage")
    for tracker in args.to:
        print(f"{tracker}: {replay(args.run_dir, tracker)}")
    return 0


def _bundle(args) -> int:
    from studio.core.config import load_config
    from studio.core.run.bundle import parse_hosts, write_bundle

    config = load_config(args.config)
    out = args.out or args.config.parent / f"{config.name}-bundle"
    bundle = write_bundle(config, parse_hosts(args.hosts), args.gpus_per_host, out, args.port)
    print(f"wrote {bundle.folder}: copy it to every machine and run launch-node-RANK there (see README.txt)")
    for item in bundle.required_on_every_node:
        print(f"  must exist on every machine: {item}")
    return 0


def _doctor(args) -> int:
    import json

    from studio.core.run.commands import EXIT_FAILED, EXIT_OK, doctor_checks_command
    from studio.core.runtime.self_test import default_report_path, finish, techniques_named

    techniques_named(args.only)  # an unknown name is refused before anything starts
    out = args.out or default_report_path()
    work = out.with_name(out.stem + "-runs")
    work.mkdir(parents=True, exist_ok=True)
    found = _run_checks(doctor_checks_command(sys.executable, work, args.only), work)
    report = finish(found, out)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(f"{report.as_text()}\nReport: {out} (and {out.with_suffix('.json').name} beside it): attach it to a "
              "bug report.")
    return EXIT_FAILED if report.failed else EXIT_OK


def _run_checks(command: list[str], work: Path) -> dict:
    """The checks' JSON; their progress lines pass to stderr, the rest of their chatter to a log in ``work``."""
    import subprocess

    from studio.core.run.commands import last_json_object

    with open(work / "checks.out", "w+") as out, open(work / "checks.log", "w") as log:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                   errors="replace")
        for line in process.stderr:
            log.write(line)
            if line.startswith("doctor: "):
                print(line.rstrip(), file=sys.stderr, flush=True)
        process.wait()
        out.seek(0)
        found = last_json_object(out.read())
    if found is None:
        raise StudioError(f"the self-test's checks stopped (exit code {process.returncode}) without a report",
                          f"see {work / 'checks.log'}", kind="internal")
    return found


def _config(args) -> int:
    from studio.core.config import key_lines, load_config, reference_markdown, save_config
    from studio.core.validation import raise_if_invalid

    if args.action == "reference":
        from studio.core.memory.savers import savers_reference

        print(reference_markdown() + savers_reference(), end="")
        return 0
    if args.file is None:
        raise StudioError(f"`studio config {args.action}` needs a file", f"run `studio config {args.action} my-run.yaml`", kind="usage")
    if args.action == "init":
        from studio.core.presets import demo_config, vision_demo_config

        if args.file.exists():
            raise StudioError(f"{args.file} already exists", "choose a new file name; nothing was overwritten", kind="usage")
        save_config(vision_demo_config() if args.vision else demo_config(), args.file)
        print(f"wrote {args.file}: the {'vision ' if args.vision else ''}demo run; edit model.name_or_path and "
              "data.train_files for your own")
        return 0
    from studio.train.data.hub import load_hub_datasets
    from studio.train.preflight import check_model, inspect_data

    config = load_config(args.file)
    raise_if_invalid(config, str(args.file), lines=key_lines(args.file))
    load_hub_datasets(config)
    report, _ = inspect_data(config)
    check_model(config)  # imports transformers only for an architecture the estimator does not know
    # the data tab's measure renders responses: a pair's lengths are measured when training starts, and grpo's
    # prompts have no response (the model writes them)
    note = "" if config.objective_format else _check_lengths(config, report.format)
    print(f"{args.file}: valid; {report.rows} training rows in {report.format} format")
    if note:
        print(f"  {note}")
    return 0


def _check_lengths(config, fmt: str) -> str:
    """Every training row measured with the model's tokenizer (as the data tab does): raises when no row keeps a
    token of its response within data.max_length; else a warning naming the rows left out, or a note that no
    tokenizer was there to count with."""
    from studio.core.data.dataset import beyond_max_length_problems, beyond_max_length_warning
    from studio.core.errors import ProblemsError
    from studio.core.data.templates import Learning
    from studio.gui.state.data_preview import rows_beyond, tokenizer_of
    from studio.gui.state.model_summary import summarize_model

    data = config.data
    try:
        tokenizer = tokenizer_of(summarize_model(config.model.name_or_path, config.model.revision))
    except StudioError:  # not on this machine yet: the worker downloads it and measures then
        tokenizer = tokenizer_of(None)
    measured = rows_beyond(data.train_files, fmt, data.template, tokenizer, data.max_length, data.train_on_prompt,
                           Learning.of(data))
    if measured is None:
        return ("note: the rows' token lengths are not checked: the model's tokenizer.json is not on this machine "
                "(training measures them)")
    beyond, rows = measured
    if beyond and len(beyond) == rows:
        raise ProblemsError(beyond_max_length_problems(beyond, data.max_length), "data", "the training data")
    if not beyond:
        return ""
    message, hint = beyond_max_length_warning(beyond, f"{rows:,} training rows", data.max_length,
                                              f"a run trains on the other {rows - len(beyond):,} rows")
    return f"warning: {message}\n  hint: {hint}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # plain `studio` opens the desktop app
        from studio.gui.app import main as open_window

        return open_window()
    return run_handler(args.handler, args)


if __name__ == "__main__":
    sys.exit(main())
