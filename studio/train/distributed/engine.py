"""How one training process drives its model: alone, data parallel, sharded by FSDP or DeepSpeed ZeRO.

The worker's loop is the same in every case; an engine supplies what differs:
wrapping the model and optimizer, the backward pass and optimizer step, the small
collectives that keep the processes' bookkeeping in agreement, and the parts of a
checkpoint that are spread over the processes.

- ``AccelerateEngine``: one process, DDP (``sharding: none``) or FSDP2 (``fsdp``),
  through accelerate, which reads the rank and world size torchrun put into the
  environment (NCCL on GPUs, gloo on the CPU). FSDP loads sharded: rank 0 reads the
  weights, the others build the model on the meta device and receive their shards.
- ``PipelineEngine``: pipeline parallel (``pipeline_stages``): each process one stage of the model
  (studio.train.distributed.pipeline) in one of ``num_processes / pipeline_stages`` data replicas, whose
  stages read the same micro-batches.
- ``DeepSpeedEngine``: ZeRO stages 1-3 with optional CPU/NVMe offload through
  ``deepspeed.initialize`` directly, so that the accumulation boundary is the
  worker's own (accelerate's wrapper would step DeepSpeed at every micro-batch).

Checkpoints stay consolidated: rank 0 writes the trained tensors whole, so resume
on another layout and ``studio export`` read them as from a single-process run. The
optimizer state is written whole by rank 0 too, except under ZeRO, where each rank
writes its own shard through DeepSpeed's ``save_checkpoint``: a run on several
machines therefore needs its run directory on a filesystem they share.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from studio.core.choices import choice_label
from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.placement import ranges_in_words
from studio.core.memory.sharding import model_width
from studio.core.model.info import load_model_config
from studio.core.run.directory import atomic_folder
from studio.train.measure.metrics import LoadingMemory
from studio.train.model.build import count_parameters, trainable_state_dict
from studio.train.optim import build_optimizer
from studio.train.savers.host_weights import keep_weights_on_cpu

log = logging.getLogger("studio.train")

OPTIMIZER_FILE = "optimizer.pt"
DEEPSPEED_FOLDER, DEEPSPEED_TAG = "deepspeed", "state"


def process_rank() -> int:
    """This process's global rank (0 outside a launcher)."""
    return int(os.environ.get("RANK", "0"))


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def leave_process_group() -> None:
    """End this rank's membership of the process group (NCCL warns, and can hang at exit, otherwise)."""
    dist = _dist()
    if dist is not None:
        dist.destroy_process_group()


class AccelerateEngine:
    """One process, DDP or FSDP through accelerate."""

    def __init__(self, config: RunConfig):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import DistributedType

        AcceleratorState._reset_state(reset_partial_state=True)  # several runs in one process (tests, demo)
        self.config = config
        mixed = {"fp32": "no"}.get(config.training.precision, config.training.precision)
        fsdp = config.distributed.sharding == "fsdp"
        # Loaded sharded: rank 0 alone reads the weights, the others build the model on the meta device and
        # receive their shard of each weight from rank 0 when accelerate shards it (8-bit weights load whole).
        self.fsdp_loads_sharded = config.sharded_loading == "fsdp"
        # refused before accelerate sees the plugin: it marks the process environment for FSDP, which every later
        # Accelerator in this process (and its children) would follow
        if fsdp and int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise StudioError("FSDP needs several processes", "set distributed.num_processes to 2 or more, or sharding to none",
                              kind="config")
        plugin = _fsdp_plugin(self.fsdp_loads_sharded) if fsdp else None
        self.accelerator = Accelerator(mixed_precision=mixed, cpu=not torch.cuda.is_available(), fsdp_plugin=plugin)
        if fsdp and self.accelerator.distributed_type == DistributedType.MULTI_CPU:
            _shard_on_the_cpu(self.accelerator, plugin, mixed)
        self.fsdp = fsdp
        self.device = self.accelerator.device
        self.rank, self.world_size = self.accelerator.process_index, self.accelerator.num_processes

    pipeline = None  # the PipelineEngine's stage and schedule

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """How many processes train on different rows (the data plan's shares): every one, but in a pipeline."""
        return self.world_size

    @property
    def replica(self) -> int:
        """This process's share of the data plan."""
        return self.rank

    @property
    def is_local_main(self) -> bool:
        """The first process of this machine."""
        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    @contextlib.contextmanager
    def local_main_first(self) -> Iterator[None]:
        """The first process of each machine runs the block while the others wait; then they run it,
        finding its results (downloads in the Hub cache, prepared data on disk)."""
        if not self.is_local_main:
            self.barrier()
        yield
        if self.is_local_main:
            self.barrier()

    # ------------------------------------------------------------ the model
    def build_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return build_optimizer(self.config, params)

    def load_model(self, build: Callable[[torch.device], torch.nn.Module]) -> torch.nn.Module:
        """``build(device)`` where this process builds the model (``build_device``), as this engine loads it
        (``loading``), with the process's loading memory measured until ``prepare`` has placed it."""
        self._loading = LoadingMemory(self.device)
        with self._loading, self.loading():
            return build(self.build_device)

    def prepare(self, model, optimizer, first_forward: Callable[[torch.nn.Module], None]):
        """The model and optimizer wrapped for training, in the order this engine needs.

        ``first_forward(model)`` runs the unwrapped model's first forward pass (the packing probe): before
        wrapping, and before torch.compile, where this process holds whole weights; after wrapping where they are
        sharded, on every rank (the engine gathers each layer's shards). Wrapping moves every weight to the
        device, so the weights a run keeps in CPU RAM go back there afterwards.
        """
        if not self.loads_sharded:
            first_forward(model)
        if self.config.training.torch_compile:
            model.compile(dynamic=True)  # in place: attributes, state dict names and checkpoints stay as they are
        with self._loading if self.shards_in_prepare else contextlib.nullcontext():
            wrapped = self._wrap(model, optimizer)
        if self.loads_sharded:
            log.info("loaded sharded (%s): this process holds %s of the %s weights",
                     choice_label("distributed.sharding", self.config.distributed.sharding),
                     f"{self.weights_held(model):,}", f"{count_parameters(model)[1]:,}")
        keep_weights_on_cpu(model, self.config, self.device)
        if self.loads_sharded:
            first_forward(model)
        return wrapped

    def loading_memory(self) -> list[dict]:
        """Every rank's loading memory (``load_model``), in rank order (a collective: every rank calls it)."""
        return self.gather(self._loading.figures(self.rank, self.loads_sharded))

    def _wrap(self, model, optimizer):
        if not self.fsdp_loads_sharded:
            self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
            return self.model, self.optimizer
        _share_unsaved_buffers_from_rank0(model, self.device)
        names = {id(param): name for name, param in model.named_parameters()}
        groups = [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        # accelerate finds each sharded parameter's optimizer entry by storage address, which all meta
        # tensors share (0): on the ranks that built on meta, the entries are matched again by name.
        sharded = dict(model.named_parameters())
        for group, group_names in zip(self.optimizer.param_groups, groups):
            group["params"] = [sharded[name] for name in group_names]
        return self.model, self.optimizer

    def loading(self):
        """Around building the model: how each process loads it (FSDP: see ``build_device``)."""
        return contextlib.nullcontext()

    @property
    def loads_sharded(self) -> bool:
        return self.fsdp_loads_sharded

    @property
    def build_device(self) -> torch.device:
        """Where this process builds the model. FSDP's sharded load: rank 0 in CPU RAM, the others on the meta
        device (no weights); ``prepare`` then hands each rank its shards of rank 0's weights."""
        if not self.fsdp_loads_sharded:
            return self.device
        return torch.device("cpu" if self.is_main else "meta")

    @property
    def shards_in_prepare(self) -> bool:
        """Whether ``prepare`` completes the loading (FSDP's sharded load)."""
        return self.fsdp_loads_sharded

    def weights_held(self, model) -> int:
        """The weights this process holds (its shards, when sharded)."""
        return sum(_local(p).numel() for p in model.parameters())

    def autocast(self):
        return self.accelerator.autocast()

    def micro_batch(self, last: bool):
        """Around forward and backward: gradients are synchronized on the last micro-batch only."""
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.accelerator.backward(loss)

    def optimizer_step(self, after_step: Callable[[], None] = lambda: None) -> float:
        """Clip, step, run ``after_step`` (it may read the gradients), clear the gradients;
        returns the gradient norm before clipping."""
        max_norm = self.config.training.max_grad_norm
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        after_step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def optimizer_state(self):
        """The tensors of the optimizer state in this process (for the memory tracker)."""
        return list(self.optimizer.state.values())

    # ------------------------------------------------------------ collectives
    def all_sum(self, values: list[float]) -> list[float]:
        dist = _dist()
        if dist is None or self.world_size == 1:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when it is true on one: ranks stop at the same step."""
        return self.all_sum([float(flag)])[0] > 0

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (on every rank)."""
        dist = _dist()
        if dist is None or self.world_size == 1:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def barrier(self) -> None:
        dist = _dist()
        if dist is not None and self.world_size > 1:
            dist.barrier()

    # ------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def shared_staging(self, destination: Path) -> Iterator[Path]:
        """A staging folder every rank writes into; rank 0 renames it into place once all are done."""
        with atomic_folder(destination, replace=True) if self.is_main else contextlib.nullcontext() as staging:
            staging = Path(self.gather(str(staging) if self.is_main else None)[0])
            yield staging
            self.barrier()

    def trainable_tensors(self, raw_model) -> dict[str, torch.Tensor]:
        """The trained tensors, whole, on rank 0 (a collective: every rank calls it)."""
        if not self.fsdp:
            return trainable_state_dict(raw_model)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model, options=_full_state(ignore_frozen_params=True))
        # torch drops a frozen weight under its first name only: a tied output layer would stay in under its own
        trained = {name for name, param in raw_model.named_parameters(remove_duplicate=False) if param.requires_grad}
        return {name: tensor.contiguous() for name, tensor in state.items() if name in trained}

    def save_optimizer(self, folder: Path) -> None:
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            state = get_optimizer_state_dict(self.model, self.optimizer, options=_full_state())
        else:
            state = self.optimizer.state_dict()
        if self.is_main:
            torch.save(state, folder / OPTIMIZER_FILE)

    def load_optimizer(self, checkpoint: Path) -> None:
        # to the CPU first: every rank reads rank 0's file, which would otherwise land on rank 0's GPU
        state = torch.load(checkpoint / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(self.model, self.optimizer, state, options=_full_state(cpu_offload=False))
        else:
            self.optimizer.load_state_dict(state)


def _full_state(**options):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**{"full_state_dict": True, "cpu_offload": True, **options})


def _fsdp_plugin(sharded_loading: bool):
    from accelerate import FullyShardedDataParallelPlugin

    # FSDP2, one shard unit per transformer block (transformers names them in _no_split_modules).
    # cpu_ram_efficient_loading: accelerate moves the model to meta, shards it there, and broadcasts
    # rank 0's weights tensor by tensor, each rank keeping its shard (fsdp2_load_full_state_dict).
    return FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
                                          state_dict_type="FULL_STATE_DICT", cpu_ram_efficient_loading=sharded_loading)


def _shard_on_the_cpu(accelerator, plugin, mixed: str) -> None:
    """Apply the FSDP plugin to a group of CPU processes, as accelerate's state does across accelerators.

    accelerate makes several CPU processes MULTI_CPU (plain DDP) and ignores the plugin there, although its
    FSDP2 path is device-agnostic and torch's ``fully_shard`` runs over gloo: the state is set as its
    constructor sets it for GPUs (the plugin's mixed precision, then the type). Nothing else that accelerate
    decided at construction differs on the CPU: it refuses fp16 there, and bf16 is autocast either way."""
    from accelerate.utils import DistributedType

    if mixed != "no":
        plugin.set_mixed_precision(mixed)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP


def _share_unsaved_buffers_from_rank0(model, device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies) from rank 0 to the ranks that built the model on meta:
    the sharded load fills only what a state dict holds (accelerate keeps these buffers as they are)."""
    import torch.distributed as dist

    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if name in module._non_persistent_buffers_set:
                real = torch.empty_like(buffer, device=device) if buffer.is_meta else buffer.to(device)
                dist.broadcast(real, src=0)
                module.register_buffer(name, real, persistent=False)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter: its FSDP shard, its ZeRO-3 partition, or the parameter."""
    if hasattr(param, "to_local"):
        return param.to_local()
    return getattr(param, "ds_tensor", param)


class DeepSpeedEngine(AccelerateEngine):
    """ZeRO 1-3 with offload through ``deepspeed.initialize``; see deepspeed_config for the JSON."""

    def __init__(self, config: RunConfig, run_dir: Path):
        from studio.train.distributed import deepspeed_config

        self.config, self.fsdp, self.fsdp_loads_sharded = config, False, False
        self.device = _init_deepspeed_process_group()
        import torch.distributed as dist

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        width = model_width(load_model_config(config.model.name_or_path, config.model.revision))
        self.ds_config = deepspeed_config.deepspeed_config(config, self.world_size, width)
        if self.is_main:
            deepspeed_config.write(self.ds_config, run_dir)

    def build_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        t = self.config.training
        if self.config.distributed.offload_optimizer == "none" or t.optimizer != "adamw":
            return build_optimizer(self.config, params)
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # AdamW on offloaded state; its C++ op builds once

        return DeepSpeedCPUAdam(params, lr=t.learning_rate, weight_decay=t.weight_decay, adamw_mode=True)

    def _wrap(self, model, optimizer):
        import deepspeed

        self.model, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        return self.model, self.optimizer

    @property
    def loads_sharded(self) -> bool:
        return self.ds_config["zero_optimization"]["stage"] == 3

    def loading(self):
        """ZeRO-3: each process builds only its shard of every weight (transformers' zero.Init integration) and
        rank 0 alone reads the checkpoint, so no process holds the whole model."""
        return _zero3_loading(self.ds_config) if self.loads_sharded else contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()  # DeepSpeed casts the weights to its bf16/fp16 itself

    def micro_batch(self, last: bool):
        self.model.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.model.backward(loss, scale_wrt_gas=False)  # the worker already divides by the step's tokens
        self.model.step()  # steps the optimizer only at the boundary set in micro_batch

    def optimizer_step(self, after_step: Callable[[], None] = lambda: None) -> float:
        """DeepSpeed stepped in the last backward; ``after_step`` runs here (validation keeps AdaLoRA,
        which needs whole gradients, away from ZeRO)."""
        after_step()
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def optimizer_state(self):
        return []  # held in DeepSpeed's flat partitions; the tracker counts what the step allocates

    def trainable_tensors(self, raw_model) -> dict[str, torch.Tensor]:
        """The trained tensors, whole, on rank 0 (a collective). Under ZeRO-3 they are gathered one at
        a time, so no GPU ever holds all of them: for full fine-tuning that is the whole model."""
        import deepspeed

        tensors = {}
        for name, param in raw_model.named_parameters():
            if param.requires_grad:
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):  # no-op below ZeRO-3
                    if self.is_main:
                        tensors[name] = param.detach().to("cpu").contiguous()
        return tensors

    def save_optimizer(self, folder: Path) -> None:
        self.model.save_checkpoint(str(folder / DEEPSPEED_FOLDER), tag=DEEPSPEED_TAG, save_latest=False,
                                   exclude_frozen_parameters=True)

    def load_optimizer(self, checkpoint: Path) -> None:
        folder = checkpoint / DEEPSPEED_FOLDER
        if not folder.is_dir():
            raise StudioError(f"checkpoint {checkpoint} holds no DeepSpeed state", "resume with the sharding it was written with",
                              kind="checkpoint")
        loaded, _ = self.model.load_checkpoint(str(folder), tag=DEEPSPEED_TAG, load_module_strict=False,
                                               load_lr_scheduler_states=False)
        if loaded is None:
            raise StudioError(f"DeepSpeed could not load {folder}", "resume with the same number of processes", kind="checkpoint")


@contextlib.contextmanager
def _zero3_loading(ds_config: dict) -> Iterator[None]:
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    active = HfDeepSpeedConfig(ds_config)  # transformers holds it weakly: it must live while the model loads
    try:
        yield
    finally:
        unset_hf_deepspeed_config()  # later runs in this process (and peft) see no ZeRO-3
        del active


def _init_deepspeed_process_group() -> torch.device:
    """The process group DeepSpeed needs, also for a single process started without a launcher."""
    import deepspeed
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if _dist() is None and "RANK" not in os.environ:
        # One process without torchrun: a one-member group on a free port, made here so that
        # RANK/WORLD_SIZE stay unset (they would make later runs in this process "launched").
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        os.environ.setdefault("LOCAL_RANK", "0")  # read by DeepSpeed (its offload too); without WORLD_SIZE, not "launched"
    deepspeed.init_distributed(dist_backend=backend)  # adopts torch's group, or makes it from torchrun's env
    if not cuda:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PipelineEngine(AccelerateEngine):
    """Pipeline parallel, in ``replicas`` data replicas: every process builds the whole model and trains its stage
    of it on its replica's micro-batches (the data plan's share), which every stage of the replica reads alike.

    Rank ``replica * stages + stage`` runs ``stage`` of ``replica`` (a 2-D mesh, replicas x stages): a replica's
    stages are consecutive ranks, so torchrun puts them on one machine when a machine holds a whole replica. They
    exchange hidden states at every micro-batch, while the replicas exchange only the trained (adapter) gradients
    once per step: the heavy, frequent traffic stays on the fast link. Each replica's last stage holds its loss."""

    def __init__(self, config: RunConfig):
        super().__init__(config)
        from torch.distributed.device_mesh import init_device_mesh

        self.stages = config.distributed.pipeline_stages
        mesh = init_device_mesh(self.device.type, (self.world_size // self.stages, self.stages),
                                mesh_dim_names=("replica", "stage"))
        self.stage_group, self.replica_group = mesh.get_group("stage"), mesh.get_group("replica")
        self.stage = self.rank % self.stages
        self.is_last_stage = self.stage == self.stages - 1

    @property
    def replicas(self) -> int:
        return self.world_size // self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    def prepare(self, model, optimizer, first_forward: Callable[[torch.nn.Module], None]):
        """This process's stage and the schedule, cut from the whole model, whose other parts go to the meta device
        (the optimizer keeps them, gradient-less: never stepped)."""
        from studio.train.distributed.pipeline import Pipeline

        first_forward(model)
        self.pipeline = Pipeline(model, self.config, self.stage, self.stages, self.device, group=self.stage_group)
        held = sum(p.numel() for p in model.parameters() if not p.is_meta)
        blocks = ranges_in_words([index for chunk in self.pipeline.blocks for index in chunk], "block")
        log.info("pipeline stage %d of %d (replica %d of %d): %s; this process holds %s of the %s weights",
                 self.stage, self.stages, self.replica, self.replicas, blocks, f"{held:,}",
                 f"{count_parameters(model)[1]:,}")
        self.model, self.optimizer = model, optimizer
        return model, optimizer

    def optimizer_step(self, after_step: Callable[[], None] = lambda: None) -> float:
        """Sum each stage's gradients over the replicas (each replica's loss is already divided by the step's
        target tokens over every replica, so the sum is one process's gradient), clip by the norm of every stage's
        gradients together (as one process would), step, clear."""
        import torch.distributed as dist

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.replicas > 1:
            for grad in grads:
                dist.all_reduce(grad, group=self.replica_group)
        squares = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        dist.all_reduce(squares, group=self.stage_group)
        norm = squares.sqrt()
        max_norm = self.config.training.max_grad_norm
        if max_norm > 0:  # torch's clip_grad_norm_, over the stages
            factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for grad in grads:
                grad.mul_(factor.to(grad.dtype))
        self.optimizer.step()
        after_step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def all_sum(self, values: list[float]) -> list[float]:
        """The sum over the data replicas of their last stages' figures (which alone include the loss), on every
        process."""
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64) if self.is_last_stage else torch.zeros(len(values),
                                                                                                 dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def evaluated_loss_sum(self, batches: list[dict[str, torch.Tensor]]) -> float:
        """The summed loss of the evaluation's micro-batches through the stages, on every process: each replica
        evaluates its share of them, and every replica's last stage adds its sum."""
        return self.all_sum([self.pipeline.loss_sum(batches[self.replica::self.replicas])])[0]

    def any_rank(self, flag: bool) -> bool:
        return AccelerateEngine.all_sum(self, [float(flag)])[0] > 0

    def _first_replica(self, value: Any) -> list[Any]:
        """The stages' ``value``s of the first replica (a collective: the replicas hold the same after each step)."""
        return self.gather(value)[:self.stages]

    def trainable_tensors(self, raw_model) -> dict[str, torch.Tensor]:
        """Every stage's trained tensors, under the whole model's names (a collective)."""
        names = set(self.pipeline.trained_names(raw_model))
        mine = {name: tensor.detach().to("cpu").contiguous() for name, tensor in raw_model.named_parameters()
                if name in names}
        return {name: tensor for stage in self._first_replica(mine) for name, tensor in stage.items()}

    def save_optimizer(self, folder: Path) -> None:
        """One optimizer file, as one process writes it: each stage holds the state of its own parameters (their
        indices are the whole model's), so the stages' states together are the whole state."""
        state = self.optimizer.state_dict()
        merged = {index: entry for stage in self._first_replica(state["state"]) for index, entry in stage.items()}
        if self.is_main:
            torch.save({**state, "state": merged}, folder / OPTIMIZER_FILE)


def make_engine(config: RunConfig, run_dir: Path) -> AccelerateEngine:
    if config.distributed.deepspeed_stage is not None:
        return DeepSpeedEngine(config, run_dir)
    if config.distributed.pipeline_stages:
        return PipelineEngine(config)
    return AccelerateEngine(config)
