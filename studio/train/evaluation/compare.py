"""``studio eval RUN``: the base model and the fine-tuned one on held-out rows, side by side.

For each row, both models' loss over its completion tokens (rendered and cut exactly as in training) and,
where the row has a reference answer, their greedy answers scored by exact match, contains and token F1
(studio.core.run.evaluation). A run of a preference objective is scored on pairs: both models'
log-probabilities of each pair's chosen and rejected responses (tokenized as training tokenizes pairs), ranked as the
objective ranks them (``Preference.ranked``), the chosen response's loss, and the greedy answer to the pair's
prompt scored against the chosen response. A grpo run is scored on prompts: both models' greedy completion of each
held-out prompt (as the run's eval events answer them, up to grpo.max_completion_length tokens) scored by the run's
own rewards (its reward file run only as its config trusts it): each function's mean, the weighted total's, and
the share of prompts given every reward the row can give (``Rewards.got_everything``). The rows are the run's
held-out ones (data.eval_files, else the rows its eval_fraction held out) or files the user names. Nothing is
written until both models are done: a cancelled or failed evaluation leaves the run as it was.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from studio.core.config import RunConfig, load_config
from studio.core.data.dataset import inspect_files, iter_examples
from studio.core.data.row_formats import Example
from studio.core.data.templates import Learning
from studio.core.errors import StudioError
from studio.core.rewards import Rewards, Scores
from studio.core.run.directory import RunDir, write_atomically
from studio.core.run.evaluation import EVALUATION_FILE, MODELS, answer_scores, progress_line, summary, worst_first
from studio.train.data.images import ImageRows
from studio.train.data.prepare import (IGNORE_INDEX, RowEncoder, adds_bos, collate, encode_image_prompt,
                                       encode_preference, encode_prompt_only, held_out_rows, resolve_template)
from studio.train.evaluation.exact_match import generate_answers, rewarded_answers
from studio.train.evaluation.generate import base_model, load_run_model
from studio.train.objectives.next_token import token_logps, token_loss_sum
from studio.train.objectives.preference import Preference, SequenceLogps
from studio.train.objectives.rollout import held_out_rewards
from studio.train.tracking.writer import tracked_events

ANSWER_BATCH = 8
SPARE_NEW_TOKENS = 16  # generated beyond the longest reference of a batch, so a longer answer shows as longer
MAX_NEW_TOKENS = 256  # the longest answer, unless asked otherwise (grpo: its grpo.max_completion_length)


def evaluate_run(run_dir: Path, files: Sequence[str] = (), max_new_tokens: int | None = None) -> dict[str, Any]:
    """Evaluate the run's newest checkpoint against its base; write RUN/evaluation.json and an event."""
    config, tokenizer, model, checkpoint = load_run_model(run_dir)
    examples, source = held_out_examples(config, files)
    if config.objective == "grpo":
        scorer = _RewardScorer(tokenizer, config, examples, max_new_tokens or config.grpo.max_completion_length)
    elif config.learns_preferences:
        scorer = _PairScorer(tokenizer, config, examples, max_new_tokens or MAX_NEW_TOKENS)
    else:
        scorer = _AnswerScorer(tokenizer, config, examples, max_new_tokens or MAX_NEW_TOKENS)
    rows = scorer.rows()
    for row, scores in zip(rows, scorer.score(model, "tuned")):
        row["tuned"] = scores
    with base_model(model, config) as base:
        for row, scores in zip(rows, scorer.score(base, "base")):
            row["base"] = scores
    result = {"checkpoint": checkpoint.name, "data": list(source),
              "summary": {m: scorer.summary(rows, m) for m in MODELS}, "rows": worst_first(rows)}
    _record(RunDir(run_dir), result)
    return result


def held_out_examples(config: RunConfig, files: Sequence[str] = ()) -> tuple[list[Example], tuple[str, ...]]:
    """The rows to evaluate on and where they came from: ``files``, else data.eval_files, else the training
    rows that data.eval_fraction held out (the same seeded pick as training's)."""
    data = config.data
    chosen = tuple(files) or data.eval_files
    if chosen:
        report = inspect_files(chosen, config.row_format, keep=0)  # every problem, by file and line
        return list(iter_examples(chosen, report.format)), chosen
    if data.eval_fraction > 0:
        report = inspect_files(data.train_files, config.row_format, keep=0)
        held = held_out_rows(report.rows, data.eval_fraction, config.training.seed)
        rows = [e for i, e in enumerate(iter_examples(data.train_files, report.format)) if i in held]
        return rows, tuple(f"{name} (held out: {data.eval_fraction:g})" for name in data.train_files)
    what = "prompts" if config.objective == "grpo" else "rows"
    raise StudioError(f"the run has no held-out {what} to evaluate on",
                      f"pass --data FILE with {what} the run did not train on, or give its config data.eval_files "
                      "or data.eval_fraction", kind="usage")


def row_text(example: Example) -> dict[str, Any]:
    """Where the row is and what it asks and answers (a pair: its chosen answer, and the rejected one), to show
    beside the scores."""
    if example.kind == "preference":
        rejected = example.rejected if isinstance(example.rejected, str) else example.rejected[-1]["content"]
        return {**row_text(example.chosen_row()), "rejected": rejected}
    if example.kind == "text":
        return {"location": example.location, "prompt": example.text[:200], "reference": None}
    if example.kind == "prompt_completion":
        return {"location": example.location, "prompt": example.prompt, "reference": example.completion}
    if example.kind == "prompt_only":
        asked = _last_question(example.messages) if example.messages else example.prompt
        return {"location": example.location, "prompt": asked, "reference": example.reference or None}
    return {"location": example.location, "prompt": _last_question(example.messages[:-1]),
            "reference": example.messages[-1]["content"]}


def _last_question(turns) -> str:
    asked = [m["content"] for m in turns if m["role"] == "user"]
    if asked and not isinstance(asked[-1], str):  # a turn with images: its parts, each image as [image]
        return " ".join("[image]" if part["type"] == "image" else part.get("text", "") for part in asked[-1])
    return asked[-1] if asked else ""


class _AnswerScorer:
    """One model's loss and answers on every row, with a progress line on stderr."""

    def __init__(self, tokenizer, config: RunConfig, examples: list[Example], max_new_tokens: int,
                 encoded: list[dict[str, Any]] | None = None):
        self.tokenizer, self.examples, self.max_new_tokens = tokenizer, examples, max_new_tokens
        data, image_rows = config.data, ImageRows.for_run(config, tokenizer)
        # as training encodes the rows, the prompt never learned (the loss is over the answers)
        encoder = RowEncoder(tokenizer, data.template, data.max_length, False, data.max_length, Learning.of(data),
                             image_rows)
        self.encoded = encoded if encoded is not None else [encoder.encode(e) for e in examples]
        self.tokens = [target_tokens(tokens["labels"]) for tokens in self.encoded]
        self.prompts = {i: encode_image_prompt(e, tokenizer, data.template, image_rows)
                        for i, e in enumerate(examples) if e.kind != "text"}

    def rows(self) -> list[dict[str, Any]]:
        """Each row's text and the tokens its loss is over, for the scores to go beside."""
        return [{**row_text(example), "tokens": tokens} for example, tokens in zip(self.examples, self.tokens)]

    def summary(self, rows: list[dict[str, Any]], model: str) -> dict[str, Any]:
        return summary(rows, model)

    @torch.no_grad()
    def score(self, model, name: str) -> list[dict[str, Any]]:
        progress = Progress(f"{name} model", len(self.encoded) + len(self.prompts))
        scores = self.losses(model, progress)
        for indices in _batches(sorted(self.prompts), ANSWER_BATCH):
            for index, answer in zip(indices, self._answers(model, indices)):
                reference = self.prompts[index][2]
                scores[index].update(answer=answer.strip(), **answer_scores(answer, reference))
            progress.advance(len(indices))
        progress.done()
        return scores

    def losses(self, model, progress: "Progress") -> list[dict[str, Any]]:
        """Each row's summed loss over its completion tokens."""
        scores = []
        for tokens in self.encoded:
            batch = {k: v.to(model.device) for k, v in collate([tokens], self.tokenizer.pad_token_id).items()}
            scores.append({"loss_sum": float(token_loss_sum(model, batch))})
            progress.advance(1)
        return scores

    def _answers(self, model, indices: list[int]) -> list[str]:
        longest = max(len(self.tokenizer(self.prompts[i][2], add_special_tokens=False)["input_ids"]) for i in indices)
        budget = min(self.max_new_tokens, longest + SPARE_NEW_TOKENS)
        return generate_answers(model, self.tokenizer, [self.prompts[i][0] for i in indices], budget,
                                [self.prompts[i][1] for i in indices])


class _PairScorer(_AnswerScorer):
    """One model's log-probabilities of every pair's two responses, tokenized as training tokenizes pairs and ranked
    as the run's objective ranks them, the chosen response's loss, and the greedy answer to the pair's prompt scored
    against the chosen response (the preference as the model shows it). A pair whose prompt fills max_length has no
    response to rank: training leaves it out, and so does this."""

    def __init__(self, tokenizer, config: RunConfig, examples: list[Example], max_new_tokens: int):
        self.objective = Preference(config, None, tokenizer.pad_token_id)
        image_rows = ImageRows.for_run(config, tokenizer)  # a pair's prompt may hold images, as in training
        pairs = [encode_preference(e, tokenizer, config.data.template, config.data.max_length, image_rows=image_rows)
                 for e in examples]
        kept = [i for i, pair in enumerate(pairs) if pair["input_ids"]]
        super().__init__(tokenizer, config, [examples[i] for i in kept], max_new_tokens, [pairs[i] for i in kept])

    def losses(self, model, progress: "Progress") -> list[dict[str, Any]]:
        """Each pair's ranked log-probabilities, their margin, and the chosen response's summed loss."""
        scores = []
        for indices in _batches(list(range(len(self.encoded))), ANSWER_BATCH):
            batch = self.objective.batch([self.encoded[i] for i in indices], packed=False)
            batch = {key: value.to(model.device) for key, value in batch.items()}
            logps = SequenceLogps(token_logps(model, batch), batch, 2 * len(indices))
            chosen, rejected = self.objective.ranked(logps, len(indices))
            chosen_sums = logps.responses(average=False)[:len(indices)]
            for ranked_chosen, ranked_rejected, chosen_sum in zip(chosen.tolist(), rejected.tolist(),
                                                                  chosen_sums.tolist()):
                scores.append({"loss_sum": -chosen_sum, "chosen_logp": ranked_chosen,
                               "rejected_logp": ranked_rejected, "margin": ranked_chosen - ranked_rejected})
            progress.advance(len(indices))
        return scores


class _RewardScorer:
    """grpo: one model's greedy completion of every held-out prompt, scored by the run's rewards. A prompt without
    room for a completion in data.max_length is left out, as training leaves it out."""

    def __init__(self, tokenizer, config: RunConfig, examples: list[Example], max_new_tokens: int):
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens
        self.rewards = Rewards.for_run(config.grpo)  # the reward file: refused unless the config trusts it
        template = resolve_template(config.data.template, tokenizer)
        room = config.data.max_length - config.grpo.max_completion_length
        prompts = [encode_prompt_only(e, tokenizer, template, room, adds_bos(tokenizer)) for e in examples]
        kept = [i for i, prompt in enumerate(prompts) if prompt["input_ids"]]
        self.examples, self.prompts = [examples[i] for i in kept], [prompts[i] for i in kept]
        self.scores: dict[str, list[Scores]] = {}

    def rows(self) -> list[dict[str, Any]]:
        return [row_text(example) for example in self.examples]

    @torch.no_grad()
    def score(self, model, name: str) -> list[dict[str, Any]]:
        """Each prompt's completion, its weighted reward, each function's, and whether it got every reward."""
        progress, answered = Progress(f"{name} model", len(self.prompts)), []
        for indices in _batches(list(range(len(self.prompts))), ANSWER_BATCH):
            answered += rewarded_answers(model, self.tokenizer, [self.prompts[i] for i in indices], self.rewards,
                                         self.max_new_tokens, len(indices))
            progress.advance(len(indices))
        progress.done()
        self.scores[name] = [scores for _, scores in answered]
        return [{"answer": answer.strip(), "reward": scores.total, "rewards": scores.by_function,
                 "full_reward": self.rewards.got_everything(scores)} for answer, scores in answered]

    def summary(self, rows: list[dict[str, Any]], model: str) -> dict[str, Any]:
        """The model's means over the completions, named as the run's eval events name them (``eval_reward``,
        ``eval_rewards/NAME/mean``), the share of prompts given every reward (None with a reward file), and how the
        completions were generated."""
        full = [row[model]["full_reward"] for row in rows]
        return {"rows": len(rows), **held_out_rewards(self.scores[model], self.rewards.names),
                "full_reward": sum(full) / len(full) if full and None not in full else None,
                "reward_functions": list(self.rewards.names), "decoding": "greedy",
                "max_new_tokens": self.max_new_tokens}


def target_tokens(labels: list[int]) -> int:
    """The tokens a row's loss is over: its labels' targets (the first token predicts nothing)."""
    return sum(label != IGNORE_INDEX for label in labels[1:])


def _batches(items: list[int], size: int) -> Iterable[list[int]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


class Progress:
    """The progress line of one model, or of the benchmarks (studio.core.run.evaluation.progress_line), on stderr: redrawn in place at
    most twice a second on a terminal, a new line every second for a log or the window that reads it."""

    def __init__(self, what: str, total: int, stream=None):
        self.what, self.total, self.stream = what, max(total, 1), stream or sys.stderr  # the stream of now
        self.done_count, self.started, self.shown = 0, time.monotonic(), 0.0
        self.every, self.end = (0.5, "\r") if self.stream.isatty() else (1.0, "\n")

    def advance(self, count: int) -> None:
        self.done_count += count
        now = time.monotonic()
        if now - self.shown >= self.every or self.done_count >= self.total:
            self.shown = now
            fraction = min(self.done_count / self.total, 1.0)
            left = (now - self.started) * (1 - fraction) / fraction if fraction else None
            self.stream.write(progress_line(self.what, self.done_count, self.total, left) + "   " + self.end)
            self.stream.flush()

    def done(self) -> None:
        if self.end == "\r":
            self.stream.write("\n")
            self.stream.flush()


def _record(rd: RunDir, result: dict[str, Any]) -> None:
    """The full result to RUN/evaluation.json, its summary to the run's events."""
    write_result(rd.path / EVALUATION_FILE, result)
    record_event(rd, "evaluation", checkpoint=result["checkpoint"], data=result["data"], **result["summary"])


def write_result(path: Path, result: dict[str, Any]) -> None:
    """A result file as JSON, whole or not at all (what the Evaluate tab reads)."""
    write_atomically(path, json.dumps(result, indent=1, ensure_ascii=False))


def record_event(rd: RunDir, type_: str, **fields: Any) -> None:
    """One event appended to a finished run's events (and its TensorBoard files), by a command after training."""
    events = tracked_events(rd, load_config(rd.config))
    try:
        events.emit(type_, **fields)
    finally:
        events.close()
