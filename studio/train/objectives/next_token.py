"""The training loss: summed next-token cross-entropy over the target tokens, in fp32.

Two ways to the same number (and the same gradients, tests prove it):

- full: the model computes the logits of every position, which are upcast to fp32
  and reduced with ``cross_entropy``. Memory: several fp32 copies of
  (positions x vocabulary), padding and prompt positions included.
- chunked: the model returns its final hidden states instead (``logits_to_keep``
  of nothing), only the positions whose next token carries a loss are gathered,
  and those are projected to the vocabulary a chunk at a time. The loss is the
  last node of the graph, so each chunk's gradients (for the hidden states and any
  trainable output-layer weights) are computed right there in the forward pass and
  kept, as Liger's fused linear cross-entropy does: the fp32 logits of one chunk
  exist at a time, they are never recomputed, and the backward pass only scales
  the kept gradients. Prompt and padding positions never meet the output layer at
  all, which also saves its compute.

The chunked path needs logits that are exactly ``output_layer(hidden)``; models
that scale or soft-cap their logits (Gemma 2, Cohere, Granite) use the full path.
As it needs the output layer only while it runs, a frozen layer may wait in CPU RAM
(studio.train.savers.host_weights): each call copies it to the device and drops the copy.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
from torch.nn.functional import cross_entropy, linear, pad

from studio.core.config import RunConfig
from studio.core.memory.regime import CHUNKED_LOSS_BYTES as CHUNK_BYTES  # fp32 logits of one chunk
from studio.core.memory.regime import loss_impl_for
from studio.train.data.packing import model_inputs, pack
from studio.train.data.prepare import IGNORE_INDEX, collate

log = logging.getLogger("studio.train")

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
ENTROPY_ROWS = 128  # TRL's entropy_from_logits chunk


class NextToken:
    """Supervised fine-tuning: the summed next-token cross-entropy over the target tokens (labels != -100), whose
    step mean is over every target token of the step's micro-batches."""

    def __init__(self, output_layer: torch.nn.Module | None, pad_token_id: int):
        self.output_layer = output_layer  # the chunked loss's, or None for the full-logits loss
        self.pad_token_id = pad_token_id

    @classmethod
    def for_run(cls, config: RunConfig, model, pad_token_id: int) -> "NextToken":
        """The run's loss on its (unwrapped) model: chunked unless switched off, sharded, or the model transforms
        its logits."""
        layer = run_output_layer(config, model)
        if layer is None and loss_impl_for(config) == "chunked":
            log.info("this model transforms its logits: using the full-logits loss")
        return cls(layer, pad_token_id)

    def batch(self, rows: list[dict[str, Any]], packed: bool) -> dict[str, torch.Tensor]:
        return pack(rows) if packed else collate(rows, self.pad_token_id)

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def loss_sum(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return token_loss_sum(model, batch, self.output_layer)

    metric_sums: tuple[str, ...] = ()

    def take_metric_sums(self) -> dict[str, float]:
        return {}

    def metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        return {}


def token_loss_sum(model, batch: dict[str, torch.Tensor], output_layer: torch.nn.Module | None = None) -> torch.Tensor:
    """Summed cross-entropy over the target tokens (labels != -100); chunked when given the output layer."""
    targets = batch["labels"][:, 1:]
    if output_layer is None:
        logits = model(**model_inputs(batch)).logits
        length = batch["input_ids"].shape[1]
        if logits.shape[1] != length:  # prompt tuning prepends its virtual tokens' logits
            logits = logits[:, -length:]  # (only then: the gradient of a slice is a zero-filled copy)
        # Shifting the labels rather than the logits spares a copy of (positions x vocabulary) and of its gradient.
        next_tokens = pad(targets, (0, 1), value=IGNORE_INDEX)
        return cross_entropy(logits.flatten(0, 1).float(), next_tokens.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
    hidden = predicting_hidden_states(model, batch)
    keep = targets != IGNORE_INDEX
    return chunked_cross_entropy(hidden[keep], targets[keep], output_layer)


def predicting_hidden_states(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The final hidden states of the positions that predict a next token (all but the last), no logits.

    The model's forward computes the logits of no position; its decoder's output is taken by a forward hook, so
    that nothing else of the forward is kept (``output_hidden_states`` would keep every layer's output until the
    forward returns: with activation offload, the very block inputs it moves to CPU RAM)."""
    nothing = torch.zeros(0, dtype=torch.long, device=batch["input_ids"].device)
    final = _final_hidden_state(model)
    model(**model_inputs(batch), logits_to_keep=nothing)
    length = batch["input_ids"].shape[1]  # prompt tuning prepends its virtual tokens
    return final.take()[:, -length:-1]


class _FinalHiddenState:
    """The output of a decoder's last forward, kept by a forward hook until it is taken."""

    def __init__(self, decoder: torch.nn.Module):
        self._output: torch.Tensor | None = None
        decoder.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self._output = output[0]  # last_hidden_state (a ModelOutput's first field, or a tuple's)

    def take(self) -> torch.Tensor:
        output, self._output = self._output, None
        if output is None:
            raise RuntimeError("the model's forward did not run its decoder")
        return output


_FINAL_HIDDEN_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> its _FinalHiddenState


def _final_hidden_state(model) -> _FinalHiddenState:
    """The hook on the decoder of ``model`` (wrapped by an engine, an adapter, or neither), made once per decoder."""
    unwrapped = getattr(model, "module", model)  # DDP and DeepSpeed wrap the model as .module
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped  # a peft model's
    decoder = base.get_decoder()
    if decoder not in _FINAL_HIDDEN_STATES:
        _FINAL_HIDDEN_STATES[decoder] = _FinalHiddenState(decoder)
    return _FINAL_HIDDEN_STATES[decoder]


def chunked_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, output_layer: torch.nn.Module,
                          chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """sum(cross_entropy(output_layer(hidden).float(), targets)) without all the logits at once."""
    chunk = max(1, chunk_bytes // (4 * output_layer.weight.shape[0]))
    trainable = [p for p in output_layer.parameters() if p.requires_grad]
    project = _on_device(output_layer, hidden.device)
    if torch.is_grad_enabled() and (hidden.requires_grad or trainable):
        return _ChunkedCrossEntropy.apply(hidden, targets, project, chunk, *trainable)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        total = total + _chunk_loss(hidden[start:start + chunk], targets[start:start + chunk], project)
    return total


def chunked_token_logps(hidden: torch.Tensor, targets: torch.Tensor, output_layer: torch.nn.Module,
                        chunk_bytes: int = CHUNK_BYTES, temperature: float = 1.0,
                        entropies: list[torch.Tensor] | None = None) -> torch.Tensor:
    """log_softmax(output_layer(hidden).float() / temperature)[targets] per position, fp32, without all the logits at
    once (GRPO takes them at its sampling temperature, as TRL's). Given ``entropies``, each chunk's entropies
    (``token_entropy``) are appended to it, from the logits the chunk projects anyway.

    Unlike the summed loss, each position's gradient is only known after the forward (the preference losses weigh
    every sequence differently), so the backward projects each chunk again: one chunk's logits at a time, both
    ways, for the cost of a second pass through the output layer."""
    chunk = max(1, chunk_bytes // (4 * output_layer.weight.shape[0]))
    trainable = [p for p in output_layer.parameters() if p.requires_grad]
    project = _on_device(output_layer, hidden.device)
    if torch.is_grad_enabled() and (hidden.requires_grad or trainable):
        return _ChunkedTokenLogps.apply(hidden, targets, project, chunk, temperature, entropies, *trainable)
    return torch.cat([_chunk_logps(hidden[start:start + chunk], targets[start:start + chunk], project, temperature,
                                   entropies) for start in range(0, hidden.shape[0], chunk)])


class _ChunkedTokenLogps(torch.autograd.Function):
    """The per-position log-probabilities, each chunk projected again in the backward pass (see above)."""

    @staticmethod
    def forward(ctx, hidden, targets, output_layer, chunk, temperature, entropies, *trainable):
        ctx.save_for_backward(hidden, targets)
        ctx.output_layer, ctx.chunk, ctx.temperature, ctx.trainable = output_layer, chunk, temperature, trainable
        # the backward projects again as the forward did: under its autocast (fp32 hidden states of a k-bit model
        # meet a 16-bit output layer there), which backward passes run outside of
        device = hidden.device.type
        ctx.autocast = torch.autocast(device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        with torch.no_grad():
            return torch.cat([_chunk_logps(hidden[start:start + chunk], targets[start:start + chunk], output_layer,
                                           temperature, entropies) for start in range(0, hidden.shape[0], chunk)])

    @staticmethod
    def backward(ctx, logps_grad):
        hidden, targets = ctx.saved_tensors
        chunk, trainable = ctx.chunk, ctx.trainable
        hidden_grad = torch.zeros_like(hidden)
        weight_grads = [torch.zeros_like(p) for p in trainable]
        for start in range(0, hidden.shape[0], chunk):
            with torch.enable_grad(), ctx.autocast:
                piece = hidden[start:start + chunk].detach().requires_grad_()
                logps = _chunk_logps(piece, targets[start:start + chunk], ctx.output_layer, ctx.temperature)
                grads = torch.autograd.grad(logps, [piece, *trainable], logps_grad[start:start + chunk],
                                            allow_unused=True)
            hidden_grad[start:start + chunk] = grads[0]
            for kept, grad in zip(weight_grads, grads[1:]):
                if grad is not None:
                    kept += grad
        return hidden_grad, None, None, None, None, None, *weight_grads


def _chunk_logps(hidden: torch.Tensor, targets: torch.Tensor, output_layer, temperature: float = 1.0,
                 entropies: list[torch.Tensor] | None = None) -> torch.Tensor:
    logits = output_layer(hidden).float() / temperature
    if entropies is not None:
        entropies.append(token_entropy(logits).to(hidden.device))
    return -cross_entropy(logits, targets.to(logits.device), reduction="none").to(hidden.device)


def token_logps(model, batch: dict[str, torch.Tensor], output_layer: torch.nn.Module | None = None,
                temperature: float = 1.0, entropies: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The log-probability of each target token (labels != -100), in the order of ``labels[:, 1:]``'s targets,
    fp32, of the logits divided by ``temperature``; chunked when given the output layer, else from the full logits.
    Given ``entropies``, the entropies of the same positions' distributions are appended to it (``token_entropy``;
    in pieces when chunked), from the same logits: no second forward."""
    targets = batch["labels"][:, 1:]
    keep = targets != IGNORE_INDEX
    if output_layer is not None:
        return chunked_token_logps(predicting_hidden_states(model, batch)[keep], targets[keep], output_layer,
                                   temperature=temperature, entropies=entropies)
    logits = model(**model_inputs(batch)).logits
    logits = logits[:, -batch["input_ids"].shape[1]:-1]  # prompt tuning prepends its virtual tokens' logits
    scaled = logits[keep].float() / temperature
    if entropies is not None:
        entropies.append(token_entropy(scaled))
    return -cross_entropy(scaled, targets[keep], reduction="none")


@torch.no_grad()
def token_entropy(logits: torch.Tensor, rows: int = ENTROPY_ROWS) -> torch.Tensor:
    """Each row's entropy in nats, TRL's ``entropy_from_logits`` (``-sum(p * log p)`` of its softmax), ``rows`` at a
    time: a metric, without gradients."""
    return torch.cat([_entropy(chunk) for chunk in logits.split(rows)])


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp(z) - sum(p * z)``, the same entropy with one (rows x vocabulary) tensor beside the logits, the
    probabilities made in place: the chunked loss's peak stays the one the estimate counts (logits and log-softmax)."""
    with torch.autocast(logits.device.type, enabled=False):  # fp32 throughout, also the dot product
        top = logits.max(dim=-1, keepdim=True).values
        probabilities = (logits - top).exp_()
        total = probabilities.sum(dim=-1, keepdim=True)
        expected = torch.bmm(probabilities.div_(total).unsqueeze(1), logits.unsqueeze(2)).view(-1)
        return (total.log() + top).view(-1) - expected


def _on_device(output_layer: torch.nn.Module, device: torch.device):
    """The output layer as the loss calls it. One kept in CPU RAM (studio.train.savers.host_weights, a frozen
    ``nn.Linear``) is copied to ``device`` once, here: the loss computes all its gradients before it returns,
    and the copy goes with it. Always a copy, also on the CPU, where it is what a GPU would hold for the loss."""
    if getattr(output_layer, "outputs_device", None) is None:
        return output_layer
    weight, bias = (None if p is None else p.to(device, non_blocking=True, copy=True)
                    for p in (output_layer.weight, output_layer.bias))
    return functools.partial(linear, weight=weight, bias=bias)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The chunked loss, with its gradients computed chunk by chunk in the forward pass (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, targets, output_layer, chunk, *trainable):  # output_layer: what _on_device gives
        hidden_grad = torch.zeros_like(hidden, dtype=torch.float32)
        weight_grads = [torch.zeros_like(p, dtype=torch.float32) for p in trainable]
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            with torch.enable_grad():
                piece = hidden[start:start + chunk].detach().requires_grad_()
                loss = _chunk_loss(piece, targets[start:start + chunk], output_layer)
                grads = torch.autograd.grad(loss, [piece, *trainable], allow_unused=True)
            hidden_grad[start:start + chunk] = grads[0]
            for kept, grad in zip(weight_grads, grads[1:]):
                if grad is not None:  # a trainable part the head skips (a disabled adapter) gets zeros
                    kept += grad
            total += loss.detach()
        ctx.save_for_backward(hidden_grad, *weight_grads)
        ctx.dtypes = [hidden.dtype, *(p.dtype for p in trainable)]
        return total

    @staticmethod
    def backward(ctx, loss_grad):
        # Scaled in fp32, then cast: with fp16's loss scaling, the scaled gradient is what must fit.
        scaled = [(grad * loss_grad).to(dtype) for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes)]
        return scaled[0], None, None, None, *scaled[1:]


def _chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, output_layer: torch.nn.Module) -> torch.Tensor:
    # Under a layer split the head may sit on another GPU (its hook moves the input there): the loss comes back.
    logits = output_layer(hidden).float()
    return cross_entropy(logits, targets.to(logits.device), reduction="sum").to(hidden.device)


def run_output_layer(config: RunConfig, model) -> torch.nn.Module | None:
    """The output layer the run's chunked loss projects with, or None: the full-logits loss (switched off, sharded
    weights, or logits the model transforms)."""
    return lean_output_layer(model) if loss_impl_for(config) == "chunked" else None


def lean_output_layer(model) -> torch.nn.Module | None:
    """The model's output layer if its logits are plainly ``layer(hidden)``, else None (use the full loss)."""
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    layer = model.get_output_embeddings()
    return layer if isinstance(getattr(layer, "weight", None), torch.Tensor) else None
