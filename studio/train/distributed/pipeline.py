"""Pipeline parallelism: a decoder-only causal LM cut at its block list into stages, one per process.

No code per architecture: the stages are built from the model's own modules (peft's adapters in them), found
generically through transformers' ``get_decoder`` and ``get_output_embeddings``: the decoder's block list, its
input embeddings, its rotary embedding and its final norm. The first stage embeds the tokens, every stage runs
its consecutive blocks, the last one the final norm; only hidden states flow between the processes, and each
stage recomputes the positions, the rotary table and the causal mask from the attention mask every stage is
given. The loss is the single-process worker's: the summed next-token cross-entropy of the last stage's hidden
states through the output layer, divided by the step's target tokens (``StepLoss``).

A family is refused, before any step, when its decoder holds more than those parts, when its blocks need other
inputs or add losses (a mixture of experts' router), or when the stages chained together do not give the
model's own logits (``check_stages``: an embedding scaled in the forward, a sliding-window mask).

torch.distributed.pipelining runs the step: the step's micro-batches (its gradient accumulation) are the
schedule's microbatches (GPipe, 1F1B or interleaved 1F1B); its stages infer the shapes they exchange once, so every
micro-batch is padded to ``data.max_length`` rows of the same count (``padded_step``). Each process builds the whole
model, then moves what its stage does not run to the meta device: it holds its stage's weights alone. Under the
interleaved schedule a process's stage is several chunks of blocks, not consecutive (studio.core.memory.placement
``process_chunks``), each one of torch's PipelineStages: the schedule runs them in turn.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.functional import pad

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.placement import chunk_indices, process_chunks, too_few_blocks
from studio.core.model.stages import PIPELINE_OFF_HINT, pipeline_family_refusal, pipeline_refusal_message
from studio.train.data.prepare import IGNORE_INDEX
from studio.train.objectives.next_token import chunked_cross_entropy

_BLOCK_INPUTS = {"self", "hidden_states", "attention_mask", "position_ids", "position_embeddings", "cache",
                 "past_key_values", "use_cache", "cache_position", "kwargs"}


@dataclass
class DecoderParts:
    """The modules a decoder-only LM's forward runs in order: embeddings, rotary table, blocks, norm, head."""

    config: object
    embeddings: nn.Module
    rotary: nn.Module | None
    blocks: nn.ModuleList
    norm: nn.Module
    head: nn.Module


def decoder_parts(model) -> DecoderParts:
    """The parts of ``model`` (a peft model or a transformers one); StudioError naming the family and the reason
    when its forward is not embeddings, blocks, norm and head."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    family = base.config.model_type

    def refuse(reason: str) -> StudioError:
        return StudioError(pipeline_refusal_message(family, reason), PIPELINE_OFF_HINT, kind="config")

    decoder = base.get_decoder()
    if reason := pipeline_family_refusal(decoder.config.to_dict()):  # a multimodal model's text config
        raise refuse(reason)
    lists = [child for child in decoder.children() if isinstance(child, nn.ModuleList)]
    if len(lists) != 1:
        raise refuse("its decoder holds no single list of blocks")
    embeddings = decoder.get_input_embeddings()
    rotary = [child for child in decoder.children() if type(child).__name__.endswith("RotaryEmbedding")]
    rest = [child for child in decoder.children() if child is not embeddings and child is not lists[0]
            and child not in rotary and any(True for _ in child.parameters())]
    if len(rest) != 1 or len(rotary) > 1:
        raise refuse("its decoder holds more than embeddings, blocks, a rotary embedding and a final norm")
    extra = [name for name, parameter in inspect.signature(type(lists[0][0]).forward).parameters.items()
             if name not in _BLOCK_INPUTS and parameter.default is inspect.Parameter.empty]
    if extra:
        raise refuse(f"its blocks need {', '.join(extra)} beside the hidden states, positions and mask")
    return DecoderParts(decoder.config, embeddings, rotary[0] if rotary else None, lists[0], rest[0],
                        base.get_output_embeddings())


class Stage(nn.Module):
    """Consecutive blocks of the model (the first stage with its embeddings, the last with its final norm):
    tokens or hidden states in, hidden states out."""

    def __init__(self, parts: DecoderParts, blocks: range, first: bool, last: bool):
        super().__init__()
        self.decoder_config = parts.config
        self.embeddings = parts.embeddings if first else None
        self.rotary = parts.rotary
        self.blocks = nn.ModuleList(parts.blocks[index] for index in blocks)
        self.norm = parts.norm if last else None

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embeddings(inputs) if self.embeddings is not None else inputs
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.decoder_config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  cache=None, position_ids=positions)
        rotary = self.rotary(hidden, position_ids=positions) if self.rotary is not None else None
        for block in self.blocks:
            hidden = block(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return self.norm(hidden) if self.norm is not None else hidden


def check_stages(model, parts: DecoderParts) -> None:
    """Refuse a family whose forward does more than its parts (an embedding scaled in the forward, logits
    transformed): the stages chained together must give the model's own logits on a short input."""
    tokens = torch.arange(1, 9, device=parts.head.weight.device).unsqueeze(0) % parts.head.weight.shape[0]
    mask = torch.ones_like(tokens)
    whole = Stage(parts, range(len(parts.blocks)), first=True, last=True)
    was_training = model.training
    model.eval()  # no dropout: both sides must compute the same thing
    refusal = None
    try:
        with torch.no_grad():
            expected = model(input_ids=tokens, attention_mask=mask).logits.float()
            chained = parts.head(whole(tokens, mask)).float()
        if not torch.allclose(chained, expected, rtol=1e-3, atol=1e-3 * float(expected.abs().max())):
            refusal = "their forward does more than embeddings, blocks, final norm and output layer"
    except (TypeError, ValueError, RuntimeError) as exc:  # a part that needs more than the stage gives it
        refusal = f"their parts do not run on their own ({type(exc).__name__}: {exc})"
    finally:
        model.train(was_training)
    if refusal is not None:
        raise StudioError(f"a pipeline cannot cut {model.config.model_type} models: {refusal}",
                          "set distributed.pipeline_stages to 0", kind="config")


class StepLoss:
    """The pipeline's ``loss_fn``: one micro-batch's summed next-token cross-entropy divided by the step's target
    tokens, as the single-process loop computes it (studio.train.objectives.next_token, chunked)."""

    def __init__(self, head: nn.Module):
        self.head = head
        self.target_tokens = 1  # set before each step

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        return chunked_cross_entropy(hidden[:, :-1][keep], targets[keep], self.head) / max(self.target_tokens, 1)


def padded_step(batches: list[dict[str, torch.Tensor]], rows: int, length: int, count: int) -> dict[str, torch.Tensor]:
    """The micro-batches as one batch of ``count`` micro-batches of ``rows`` rows of ``length`` tokens: positions
    padded on the right (masked, no loss), the missing rows and micro-batches filled with rows of one token that
    predict nothing (no loss, no gradient; a row attending to nothing would be NaN)."""
    nothing = {name: torch.zeros(0, 1, dtype=torch.long) for name in ("input_ids", "attention_mask", "labels")}
    filled = []
    for batch in batches + [nothing] * (count - len(batches)):
        width = length - batch["input_ids"].shape[1]
        padded = {"input_ids": pad(batch["input_ids"], (0, width)), "attention_mask": pad(batch["attention_mask"], (0, width)),
                  "labels": pad(batch["labels"], (0, width), value=IGNORE_INDEX)}
        missing = rows - padded["input_ids"].shape[0]
        filler = {"input_ids": torch.zeros(missing, length, dtype=torch.long),
                  "attention_mask": pad(torch.ones(missing, 1, dtype=torch.long), (0, length - 1)),
                  "labels": torch.full((missing, length), IGNORE_INDEX)}
        filled.append({name: torch.cat([tensor, filler[name].to(tensor.device)]) for name, tensor in padded.items()})
    return {name: torch.cat([batch[name] for batch in filled]) for name in filled[0]}


class Pipeline:
    """This process's stage of the model (its chunks of blocks) and the schedule that runs a step's micro-batches
    through every stage."""

    def __init__(self, model, config: RunConfig, stage_index: int, stages: int, device: torch.device, group=None):
        """``group``: the processes of this stage's pipeline (its replica's stages; None: every process)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        parts = decoder_parts(model)
        chunks = config.distributed.chunks_per_process
        if refusal := too_few_blocks(len(parts.blocks), stages, chunks):
            raise StudioError(refusal.message, refusal.hint, kind="config")
        if parts.head.weight is parts.embeddings.weight and parts.head.weight.requires_grad:
            raise StudioError("a pipeline cannot train a tied output layer: its first and last stage would each "
                              "update their own copy", "train an adapter (the tied weight stays frozen), or set "
                              "distributed.pipeline_stages to 0", kind="config")
        check_stages(model, parts)
        self.first, self.last = stage_index == 0, stage_index == stages - 1
        self.blocks = process_chunks(len(parts.blocks), stages, stage_index, chunks)
        indices = chunk_indices(stages, stage_index, chunks)  # each chunk's place in the model, torch's stage index
        self.modules = [Stage(parts, blocks, index == 0, index == stages * chunks - 1)
                        for blocks, index in zip(self.blocks, indices)]
        self.loss = StepLoss(parts.head)
        self.rows, self.length = config.training.micro_batch_size, config.data.max_length
        self.micro_batches = config.training.gradient_accumulation_steps
        pipeline_stages = [PipelineStage(module, index, stages * chunks, device, group=group)
                           for module, index in zip(self.modules, indices)]
        schedule = config.distributed.pipeline_schedule
        runs = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[schedule]
        # scale_grads off: StepLoss already divides by the step's target tokens
        self.schedule = runs(pipeline_stages if schedule == "interleaved" else pipeline_stages[0],
                             n_microbatches=self.micro_batches, loss_fn=self.loss, scale_grads=False)
        self.owned = {id(parameter) for module in self.modules for parameter in module.parameters()}
        if self.last:
            self.owned |= {id(parameter) for parameter in parts.head.parameters()}
        _release(parts, self.owned)

    def step(self, batches: list[dict[str, torch.Tensor]], target_tokens: int) -> float:
        """Forward and backward of the step's micro-batches through every stage; the step's loss (the per-token
        mean) on the last stage, 0 on the others."""
        self.loss.target_tokens = target_tokens
        return self._run(self.schedule.step, batches)

    def loss_sum(self, batches: list[dict[str, torch.Tensor]]) -> float:
        """The summed next-token loss of any number of micro-batches, forward only (evaluation), on the last stage;
        0 on the others."""
        self.loss.target_tokens = 1
        return sum(self._run(self.schedule.eval, batches[start:start + self.micro_batches])
                   for start in range(0, len(batches), self.micro_batches))

    def _run(self, schedule_call, batches: list[dict[str, torch.Tensor]]) -> float:
        batch = padded_step(batches, self.rows, self.length, self.micro_batches)
        losses: list[torch.Tensor] = []
        inputs = (batch["input_ids"],) if self.first else ()
        schedule_call(*inputs, target=batch["labels"] if self.last else None, losses=losses, return_outputs=False,
                      attention_mask=batch["attention_mask"])
        return sum(float(loss.detach()) for loss in losses)

    def trained_names(self, model) -> list[str]:
        """The names (as the whole model calls them) of the trained parameters this stage holds."""
        return [name for name, parameter in model.named_parameters()
                if parameter.requires_grad and id(parameter) in self.owned]


def _release(parts: DecoderParts, kept: set[int]) -> None:
    """Move every part this stage does not run (other stages' blocks; the embeddings and output layer elsewhere
    than the first and last stage, a tied one kept by both) to the meta device, its memory freed in place: the
    optimizer's parameters stay the same objects, and having no gradient, are never stepped."""
    for module in [*parts.blocks, parts.embeddings, parts.norm, parts.head]:
        if not any(id(parameter) in kept for parameter in module.parameters()):
            module.to("meta")
