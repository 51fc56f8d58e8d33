"""The frozen weights kept in CPU RAM (``training.embedding_on_cpu``, ``training.output_layer_on_cpu``).

Each stays in CPU RAM with hooks that move its input there and its output back to the device, so that
the numbers are those of a model held whole on the device. Applied after the engine has placed the model
(accelerate's prepare moves every weight to the device) and by the memory measurements.
"""

from __future__ import annotations

import torch

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.regime import embedding_on_host, output_layer_on_host
from studio.train.objectives.next_token import lean_output_layer


def keep_weights_on_cpu(model, config: RunConfig, device: torch.device) -> None:
    """The frozen weights the config keeps in CPU RAM: the input embedding and the output layer. Only for training
    (the engine's prepare, after wrapping moved the whole model; the memory measurements): exports and
    generation build their own model, with every weight where the model is."""
    keep_embedding_on_cpu(model, config, device)
    keep_output_layer_on_cpu(model, config, device)


def keep_embedding_on_cpu(model, config: RunConfig, device: torch.device) -> None:
    """``training.embedding_on_cpu``: the frozen input embedding in CPU RAM. The token ids go to it, and only the
    looked-up rows come to ``device`` (before any other hook sees them: the same numbers as a lookup there)."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    if embedding_on_host(config, tied):
        _keep_on_cpu(embedding, device, _ids_to_cpu)


def keep_output_layer_on_cpu(model, config: RunConfig, device: torch.device) -> None:
    """``training.output_layer_on_cpu``: the frozen output layer in CPU RAM (pinned, for quick copies to a GPU).
    The chunked loss copies it to ``device`` for the time it computes (studio.train.objectives.next_token), which is the only
    time training needs it: the model's own forward then computes the logits of no position, on the CPU."""
    head = lean_output_layer(model)  # None: the model transforms its logits, the full loss needs the layer there
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if head is None or not output_layer_on_host(config, tied, plain_logits=True):
        return
    if type(head).forward is not torch.nn.Linear.forward or any(p.requires_grad for p in head.parameters()):
        raise StudioError(f"the output layer ({type(head).__name__}) is not a frozen linear layer: the loss cannot "
                          "compute it from a copy", "turn training.output_layer_on_cpu off", kind="config")
    _keep_on_cpu(head, device, _hidden_to_cpu)
    if device.type == "cuda":
        for param in head.parameters():
            param.data = param.data.pin_memory()


def _keep_on_cpu(module: torch.nn.Module, device: torch.device, input_to_cpu) -> None:
    """``module`` in CPU RAM: its first input goes there, and its output comes back to ``device`` (before any
    other hook sees it)."""
    if any(p.device.type != "cpu" for p in module.parameters()):  # the simulation's fake ones are, and cannot move
        module.to("cpu")
    if getattr(module, "outputs_device", None) is None:
        module.outputs_device = device
        module.register_forward_pre_hook(input_to_cpu)
        module.register_forward_hook(_output_to_device, prepend=True)


def host_weights(model) -> list[torch.Tensor]:
    """The weights ``keep_weights_on_cpu`` keeps in host RAM."""
    modules = (model.get_input_embeddings(), model.get_output_embeddings())
    return [p for module in modules if getattr(module, "outputs_device", None) is not None for p in module.parameters()]


def _ids_to_cpu(module, args):
    return (args[0].to("cpu"), *args[1:])


def _hidden_to_cpu(module, args):
    # in the weight's dtype: autocast on a GPU does not reach CPU operations (these are the hidden states of no
    # position in training; the loss projects them)
    return (args[0].to("cpu", module.weight.dtype), *args[1:])


def _output_to_device(module, args, output: torch.Tensor) -> torch.Tensor:
    return output.to(module.outputs_device)
