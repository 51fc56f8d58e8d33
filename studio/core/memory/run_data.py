"""The estimate for the run's own data, beside the worst case at ``data.max_length``.

Data order is a pure function of the seed and the step (the worker's batch plan), so the largest
micro-batch a run will ever train, in tokens, is known before it starts: packed without padding, a
micro-batch holds the sum of its rows' lengths; padded, its size times its longest row. The estimate of
that micro-batch is the run's own peak; rows shorter than ``max_length`` make it smaller than the worst case. For
a vision-language model the images' patches are known too (each row's grids): the estimate counts the tower on the
micro-batch with the most, rather than on an image at the processor's largest resolution in every row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from studio.core.config import RunConfig


def largest_micro_batch_tokens(lengths: Sequence[int], batches: Iterable[Sequence[int]], padded: bool) -> int:
    """The most tokens (padding included when ``padded``) any of ``batches`` (row indices) holds."""
    largest = 0
    for rows in batches:
        if rows:
            row_lengths = [lengths[row] for row in rows]
            largest = max(largest, len(rows) * max(row_lengths) if padded else sum(row_lengths))
    return largest


def most_image_patches(patches: Sequence[tuple[int, ...]], batches: Iterable[Sequence[int]],
                       every_row: bool = False) -> tuple[int, ...]:
    """Each image's patches in the micro-batch of ``batches`` whose images have the most (``patches``: each row's
    images'). With the most tokens (``largest_micro_batch_tokens``, perhaps another micro-batch) it bounds the
    run's own peak on a vision-language model. ``every_row``: the model gives each row of a micro-batch as many
    image slots as its row with the most, filled (mllama's; every image of it as many patches)."""
    most: tuple[int, ...] = ()
    for rows in batches:
        images = tuple(image for row in rows for image in patches[row])
        if every_row and images:
            images = images[:1] * len(rows) * max(len(patches[row]) for row in rows)
        most = max(most, images, key=sum)
    return most


def config_for_tokens(config: RunConfig, tokens: int) -> RunConfig:
    """The config whose worst case is a micro-batch of ``tokens``: its sequences ``tokens / sequences`` long
    (never longer than ``max_length``). The estimate of it is the run's own peak."""
    rows = config.training.micro_batch_size * config.sequences_per_row
    return config.replace(data={"max_length": max(1, min(config.data.max_length, math.ceil(tokens / rows)))})


def config_for_longest_row(config: RunConfig, longest: int) -> RunConfig:
    """A bound for any micro-batch size (what fit varies): no micro-batch holds more than its size times the
    longest row, packed or padded."""
    return config.replace(data={"max_length": max(1, min(config.data.max_length, longest))})


def largest_possible_micro_batch(lengths: Iterable[int], micro_batch: int, max_length: int, padded: bool) -> int:
    """The most tokens any micro-batch of these rows (cut at ``max_length``) could hold, in any order: what is
    known without the worker's order (the window's data preview), exact for a micro-batch of one."""
    longest = sorted((min(length, max_length) for length in lengths), reverse=True)[:micro_batch]
    if not longest:
        return 0
    return len(longest) * longest[0] if padded else sum(longest)
