"""``studio estimate`` and ``studio fit``: the memory estimate and the fit solver on the command line.

``add_estimate(commands)`` and ``add_fit(commands)`` register the subcommands on
the parser's subparsers, like the other ``_add_*`` functions in studio.cli.
Both read only the model's config.json; ``estimate --simulate`` additionally
runs the training step on fake tensors in a child process, and so does
``estimate`` once for a model no family describes (its memory trace).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from studio.core.errors import StudioError
from studio.core.memory.parts import PART_LABELS, PHASE_LABELS
from studio.core.run.commands import last_json_object, simulation_command, trace_command
from studio.core.sizes import parse_size

SIMULATION_TIMEOUT_S = 600
TRACE_TIMEOUT_S = 3600  # a trace steps a few regimes of the model: minutes for a large one on a slow CPU

def _size_argument(text: str) -> int:
    import argparse

    try:
        return parse_size(text)
    except StudioError as exc:
        raise argparse.ArgumentTypeError(f"{exc.message} ({exc.hint})") from None


def _add_scale_out_arguments(parser) -> None:
    group = parser.add_argument_group("several GPUs (default: the config's distributed section)")
    group.add_argument("--gpus", type=int, help="data-parallel GPUs, or the GPUs a layer split spreads over")
    group.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage")
    group.add_argument("--offload-optimizer", action="store_true", help="ZeRO optimizer offload to CPU RAM")
    group.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter offload to CPU RAM")


def scale_out_for(args, config):
    """The flags when any is given, else the config's distributed section (a layer split takes --gpus x --gpu-memory)."""
    from studio.core.memory.estimate import ScaleOut

    if config.distributed.layer_split:
        sizes = (args.gpu_memory,) * (args.gpus or 1) if args.gpu_memory else ()
        return ScaleOut.from_config(config, sizes)
    if args.gpus is None and args.zero_stage is None and not (args.offload_optimizer or args.offload_params):
        return ScaleOut.from_config(config)
    return ScaleOut(args.gpus or 1, args.zero_stage or 0, args.offload_optimizer, args.offload_params)


def add_estimate(commands) -> None:
    p = commands.add_parser(
        "estimate", help="itemized peak GPU memory of a run config",
        description="Estimate the peak GPU memory of a run from the model's config.json alone: weights, adapters, "
                    "gradients, optimizer state, activations, logits, temporaries and CUDA overheads, and the phase "
                    "of the training step that holds the peak. See docs/memory-estimate.md.")
    p.add_argument("config", type=Path, help="the run config (YAML)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--gpu-memory", type=_size_argument, metavar="SIZE",
                   help="GPU memory to judge against, e.g. 24GiB; adds a fits / tight / does not fit verdict")
    p.add_argument("--simulate", action="store_true",
                   help="also run one real training step of the model code on fake tensors (seconds, no GPU, no weights)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (default) adds the CUDA context and allocator margin; cpu predicts a CPU run")
    p.add_argument("--data", action="store_true",
                   help="also the run's own peak: its data's largest micro-batch in its order (reads and tokenizes it)")
    _add_scale_out_arguments(p)
    p.set_defaults(handler=_estimate)


def add_fit(commands) -> None:
    p = commands.add_parser(
        "fit", help="the fastest configuration that fits a GPU",
        description="Find the configuration with the shortest expected step time that fits in the given GPU memory, "
                    "keeping the effective batch size; each change is explained with the memory it saves.")
    p.add_argument("config", type=Path, help="the run config (YAML)")
    p.add_argument("--gpu-memory", type=_size_argument, required=True, metavar="SIZE", help="e.g. 24GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--allow-offload", action="store_true", help="also consider ZeRO optimizer offload to CPU RAM")
    p.add_argument("--write", type=Path, metavar="FILE", help="save the fitted run config to FILE")
    p.add_argument("--data", action="store_true",
                   help="fit the run's own data (its longest row) rather than every row at data.max_length")
    p.add_argument("--cpu-memory", type=_size_argument, metavar="SIZE",
                   help="CPU RAM the run may take (offloaded activations, weights or optimizer state), e.g. 64GiB; "
                        "default: what this machine has available now")
    _add_scale_out_arguments(p)
    p.set_defaults(handler=_fit)


def _load(args):
    from studio.core.config import load_config
    from studio.core.model.info import load_model_config

    config = load_config(args.config)
    model_config = load_model_config(config.model.name_or_path, config.model.revision)
    return config, model_config, scale_out_for(args, config)


def run_data_tokens(config) -> tuple[int, int, tuple[int, ...]]:
    """(the largest micro-batch in tokens, the longest row, the patches of the images of the micro-batch with the
    most) of the run's own data in its order: the data is read and tokenized as the worker does
    (studio.core.memory.run_data)."""
    from studio.train.data.images import ImageRows
    from studio.train.data.prepare import prepare_data
    from studio.train.model.build import load_tokenizer
    from studio.train.worker import BatchPlan

    tokenizer = load_tokenizer(config)
    rows = prepare_data(config, tokenizer, image_rows=ImageRows.for_run(config, tokenizer)).train
    plan = BatchPlan.for_rows(config, rows)
    tokens, images = plan.largest_micro_batch(config, rows, config.distributed.num_processes,
                                              not config.packs_padding_free)
    return tokens, max(len(ids) for ids in rows["input_ids"]), images


def _estimate(args) -> int:
    from studio.core.memory.derived import kind_text
    from studio.core.memory.estimate import estimate

    config, model_config, scale_out = _load(args)
    result = _traced_first(args, model_config, lambda: estimate(model_config, config, args.device, scale_out))
    try:
        simulated = simulate_in_subprocess(args.config) if args.simulate else None
    except StudioError as exc:
        if not args.json:
            raise
        print(json.dumps({"error": exc.message, "hint": exc.hint}))  # the simulator's own failure format
        return 1
    run_data = _run_data_estimate(config, model_config, args, scale_out) if args.data else None
    if args.json:
        out = result.to_json(args.gpu_memory)
        if simulated is not None:
            out["simulated"] = simulated
        if run_data is not None:
            out["run_data"] = run_data
        print(json.dumps(out, indent=2))
    else:
        print(estimate_table(result, config, model_config, args.gpu_memory, simulated))
        if run_data is not None:
            print(run_data_text(run_data, result.peak_bytes, config.data.max_length))
        print(f"kind: {kind_text(result)}")
    return 0


def _run_data_estimate(config, model_config: dict, args, scale_out) -> dict:
    from studio.core.memory.estimate import estimate
    from studio.core.memory.run_data import config_for_tokens

    tokens, _, images = run_data_tokens(config)
    peak = estimate(model_config, config_for_tokens(config, tokens), args.device, scale_out, images=images).peak_bytes
    return {"tokens": tokens, "peak_bytes": peak, **({"image_patches": sum(images)} if images else {})}


def run_data_text(run_data: dict, worst_bytes: int, max_length: int) -> str:
    from studio.core.sizes import format_bytes

    return (f"your data: its largest micro-batch holds {run_data['tokens']:,} tokens: "
            f"{format_bytes(run_data['peak_bytes'])} (worst case, every row {max_length:,} tokens: "
            f"{format_bytes(worst_bytes)})")


def _fit(args) -> int:
    from studio.core.config import save_config
    from studio.core.machine import available_ram
    from studio.core.memory.fit import fit, fit_own_data

    config, model_config, scale_out = _load(args)
    options = {"scale_out": scale_out, "allow_offload": args.allow_offload,
               "host_bytes": args.cpu_memory or available_ram()}
    if args.data:
        longest_row = run_data_tokens(config)[1]
        result = _traced_first(args, model_config,
                               lambda: fit_own_data(model_config, config, args.gpu_memory, longest_row, **options),
                               neighbours=True)
    else:
        result = _traced_first(args, model_config, lambda: fit(model_config, config, args.gpu_memory, **options),
                               neighbours=True)
    if args.write:
        save_config(result.config, args.write)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(result.explanation)
        if args.write:
            print(f"wrote {args.write}")
    return 0 if result.fits else 1


def _traced_first(args, model_config: dict, compute, neighbours: bool = False):
    """``compute()``; for a model no family describes whose step is not traced yet, trace it first (once, in a
    subprocess: these settings, and with ``neighbours`` the ones a toggle away, which fit searches)."""
    from studio.core.memory.derived import TraceNeededError

    try:
        return compute()
    except TraceNeededError:
        if not args.json:
            also = ", with the settings one toggle away" if neighbours else ""
            print(f"tracing one training step of a small {model_config['model_type']} copy (once per model and "
                  f"settings{also})...", file=sys.stderr)
        run_json_subprocess(trace_command(sys.executable, args.config, neighbours), "the memory trace",
                            TRACE_TIMEOUT_S)
        return compute()


def simulate_in_subprocess(config_path: Path) -> dict:
    """Run ``python -m studio.train.measure.simulate`` in a child process and return its result.

    Never in the caller's process: the simulation imports the ML stack and a
    fault there must not take a window down with it.
    """
    return run_json_subprocess(simulation_command(sys.executable, config_path), "the simulation")


def run_json_subprocess(command: list[str], what: str, timeout_s: int = SIMULATION_TIMEOUT_S) -> dict:
    """Run a studio subprocess that prints its result (or ``{"error", "hint"}``) as its last JSON object."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise StudioError(f"{what} took more than {timeout_s} s", "check the model's config.json",
                          kind="simulate") from None
    result = last_json_object(done.stdout)  # libraries print to stdout too: ours is the last
    if result is None or "error" in result:
        message = result["error"] if result else (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise StudioError(f"{what} failed: {message}", (result or {}).get("hint", "see its message above"),
                          kind="simulate")
    return result




def _costly_savers(config) -> str:
    """``, gradient checkpointing, offload layer inputs to CPU RAM``: the memory savers on that cost time."""
    from studio.core.memory.savers import SAVER_SPECS

    labels = [spec.label for spec in SAVER_SPECS.values() if spec.is_on(config) and spec.slowdown > 1]
    return "".join(f", {label[:1].lower()}{label[1:]}" for label in labels)


def estimate_table(result, config, model_config: dict, gpu_bytes: int | None, simulated: dict | None = None) -> str:
    """The itemized estimate as text, with the verdict when the GPU size is known."""
    from studio.core.sizes import format_bytes

    t = config.training
    lines = [
        f"{model_config.get('model_type', '?')} model, {result.parameters / 1e9:.3g} B parameters "
        f"({result.trainable_parameters:,} trained); {config.method}, {t.precision}, "
        f"micro-batch {t.micro_batch_size} x {config.data.max_length} tokens" + _costly_savers(config),
        f"peak during {PHASE_LABELS.get(result.peak_phase, result.peak_phase)}",
    ]
    for device in result.devices:
        if len(result.devices) > 1:
            lines.append(f"{device.device}:")
        for part, value in device.parts.items():
            if value:
                lines.append(f"  {PART_LABELS[part]:<26}{format_bytes(value):>12}")
        lines.append(f"  {'total':<26}{format_bytes(device.total_bytes):>12}")
    if result.placement is not None:
        lines.append(f"layer split: {result.placement.summary()}")
    for note in result.notes:
        lines.append(f"note: {note}")
    if simulated is not None:
        lines.append(f"simulated step (fake tensors, CPU kernels): {format_bytes(simulated['peak_bytes'])} "
                     f"of tensors in {simulated['seconds']:.1f} s")
    if gpu_bytes:
        verdict = result.verdict(gpu_bytes)
        margin = format_bytes(abs(verdict.headroom_bytes))
        detail = f"{margin} to spare" if verdict.headroom_bytes >= 0 else f"{margin} more needed; try `studio fit`"
        lines.append(f"on {format_bytes(gpu_bytes)}: {verdict.status} ({detail})")
    return "\n".join(lines)
