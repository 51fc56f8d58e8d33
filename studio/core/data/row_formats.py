"""The row formats of training data: what a record's fields say it is, and validating it into an Example.

Row formats (``DataConfig.format``), detected from the fields of the first row:

- chat: ``messages`` (OpenAI role/content) or ``conversations`` (ShareGPT
  from/value with system/human/gpt); after an optional system turn, user and
  assistant turns alternate, starting with user and ending with assistant.
  TRL's conversational prompt/completion rows (``prompt`` and ``completion``
  each a list of messages) are chat rows too: the prompt's turns, then the
  completion's. Tool calling, in the OpenAI / TRL shapes: an assistant turn's
  ``tool_calls`` (``{"function": {"name", "arguments"}}`` or ``{"name", "arguments"}``) are followed by their
  results, ``tool`` turns (with an optional ``tool_call_id`` or ``name``), then by the assistant again; the
  functions the model may call are the row's ``tools`` (a list of JSON schemas, or that list as JSON text).
  LLaMA-Factory's ShareGPT shape is read too: ``function_call`` turns (the call as JSON) and ``observation``
  turns (its result). An assistant turn's reasoning is its ``reasoning_content`` or ``thinking`` (or
  ``<think>`` tags already in its content), and ``train: false`` (or ``weight: 0``) keeps the turn out of the
  loss. Images, in TRL's vision format: a turn's ``content`` is a list of parts, ``{"type": "text", "text": ...}``
  and ``{"type": "image"}``, the images the row's ``images`` column (a list of paths, in the parts' order), or a
  part names its own (``{"type": "image", "path": "x.png"}``, or ``"image"``). Paths are relative to the data file
  (``studio.core.data.dataset`` finds them); only local files: a URL is refused. Chat rows hold images in their
  user turns, conversational preference rows in their prompt's (``IMAGE_FORMATS``).
- instruction: alpaca ``instruction``, optional ``input``, ``output`` (and an
  optional ``system``); becomes a user and an assistant message.
- prompt_completion: ``prompt`` (may be empty) and ``completion``.
- text: ``text``.
- preference: TRL's preference rows, ``prompt``, ``chosen`` and ``rejected``: plain text, or each a list of
  messages (conversational). Without ``prompt`` the prompt is implicit: what chosen and rejected share from their
  start (their common turns, or characters), as TRL's ``extract_prompt`` takes it. For the pairwise objectives.
  A conversational pair's prompt may hold images (TRL's vision preference rows), as a chat row's user turns do.
- unpaired_preference: TRL's unpaired preference rows (KTO's), ``prompt``, ``completion`` and ``label`` (true: the
  completion is desirable, false: undesirable): plain text, or prompt and completion each a list of messages.
- prompt_only: TRL's prompt-only rows (GRPO's, which writes the completions): ``prompt``, plain text or a list of
  messages ending with a user turn, and an optional reference answer for the rewards, in the first of
  ``REFERENCE_COLUMNS`` the row has (text or a number). Never detected from the fields (a prompt alone says
  nothing): objective grpo reads its rows as prompt_only.

``studio.core.data.dataset`` reads the files and hands every record to ``to_messages``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from studio.core.errors import Problem, StudioError

FORMATS = ("instruction", "chat", "prompt_completion", "text", "preference", "unpaired_preference", "prompt_only")
IMAGE_FORMATS = ("chat", "preference")
"""The row formats whose rows may hold images: a chat row's user turns, a preference pair's prompt."""
ANSWERED_FORMATS = ("instruction", "chat", "prompt_completion")
"""The supervised row formats a prompt-only reader (GRPO's) takes too: the prompt, its answer the reference."""
REFERENCE_COLUMNS = ("answer", "solution", "reference")
"""Where a prompt-only row keeps its reference answer, in the order looked for: GSM8K's and MATH's names, and ours."""
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "function_call": "assistant",
                  "observation": "tool"}
_ROLE_ALIASES = {**SHAREGPT_ROLES, **{role: role for role in ROLES}}
REASONING_FIELDS = ("reasoning_content", "thinking")
"""Where an assistant turn keeps its reasoning, in the order looked for; it becomes ``reasoning_content``, the
field chat templates (Qwen3's, DeepSeek-R1's) read."""
_TOOL_HINT = ('each tool is a JSON schema: {"type": "function", "function": {"name": ..., "description": ..., '
              '"parameters": {...}}}')
_CALL_HINT = 'each call is {"function": {"name": ..., "arguments": {...}}} (or {"name": ..., "arguments": {...}})'
_ORDER_HINT = "after an optional first system turn, user and assistant turns alternate, starting with user"
_FORMAT_FIELDS = {  # the fields that make a row look like each format, in detection order
    "preference": (("chosen", "rejected"),),
    "unpaired_preference": (("completion", "label"),),
    "chat": (("messages",), ("conversations",)),
    "instruction": (("instruction", "output"),),
    "prompt_completion": (("prompt", "completion"),),
    "text": (("text",),),
}
_FORMAT_HINT = ("rows need messages, conversations, instruction+output, prompt+completion, text, chosen+rejected, "
                "or completion+label; or set data.format")
IMAGE_SOURCE_FIELDS = ("path", "image")
"""Where an inline image part names its file, in the order looked for."""
_IMAGE_HINT = ('give each {"type": "image"} part its file: the row\'s "images" list (paths relative to the data file, '
               'in the parts\' order) or the part\'s own "path"')
_PARTS_HINT = 'a content list holds {"type": "text", "text": ...} and {"type": "image"} parts'
_MISSING = object()
MAX_NESTING = 100
"""How deep a row's values may nest (lists and objects in one another): far beyond any real row, far below
Python's recursion limit, so that reading, describing and rendering a row never recurses out of the stack."""
_NESTING_HINT = f"a row's values may nest at most {MAX_NESTING} levels deep: fix or remove the row"
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


class DataError(StudioError):
    """One problem with the data; carries it as a Problem so that callers can collect many."""

    def __init__(self, where: str, message: str, hint: str = ""):
        self.problem = Problem(where, message, hint)
        super().__init__(f"{where}: {message}" if where else message, hint, kind="data")

    def at(self, location: str) -> "DataError":
        """This problem at ``location`` (a row), unless it names where it is already."""
        return self if self.problem.where else DataError(location, self.problem.message, self.problem.hint)


@dataclass(frozen=True)
class Example:
    """One validated row in a format-independent shape.

    ``kind`` is the row format. Instruction and chat rows carry ``messages``
    (dicts with ``role`` and ``content``, ready for a chat template: an assistant's may hold ``tool_calls``,
    ``reasoning_content`` and ``train`` (false: not learned), a tool result's ``tool_call_id`` or ``name``) and
    the ``tools`` the model may call (JSON schemas, OpenAI's shape);
    prompt_completion rows ``prompt`` and ``completion``; text rows ``text``.
    Preference rows carry ``chosen`` and ``rejected``: plain, as text after the text ``prompt``; conversational,
    as turns after the prompt's turns in ``messages``. Unpaired preference rows carry their ``completion`` the same
    way (text, or turns) and its ``label``.
    """

    kind: str
    messages: tuple[dict[str, Any], ...] = ()
    prompt: str = ""
    completion: str | tuple[dict[str, str], ...] = ""
    text: str = ""
    location: str = ""
    chosen: str | tuple[dict[str, str], ...] = ""
    rejected: str | tuple[dict[str, str], ...] = ""
    label: bool = False
    """unpaired_preference: whether the completion is desirable (TRL's label)."""
    reference: str = ""
    """prompt_only: the reference answer the rewards compare with ("" when the row has none)."""
    row: dict[str, Any] | None = None
    """prompt_only: the row as read, every column: what the rewards are given."""
    tools: tuple[dict[str, Any], ...] = ()
    """Conversational rows: the functions the model may call, each ``{"type": "function", "function": {...}}``."""
    images: tuple[str, ...] = ()
    """Chat rows (and a preference pair's prompt): the image files, the n-th that of the n-th ``{"type": "image"}`` part
    of the messages (whose content is then a tuple of parts; a turn without images keeps plain text). As written in
    the row until ``studio.core.data.dataset`` resolves them against the data file's folder."""

    @property
    def conversational(self) -> bool:
        """Whether a preference row's responses are turns (rendered through the chat template), not text."""
        return isinstance(self.chosen, tuple) or isinstance(self.completion, tuple)

    @property
    def responses(self) -> tuple:
        """A preference row's responses, each text or turns: (chosen, rejected), or (completion,) when unpaired."""
        return (self.completion,) if self.kind == "unpaired_preference" else (self.chosen, self.rejected)

    def chosen_row(self) -> "Example":
        """A preference pair as the response row of its chosen answer (chat, or prompt_completion for plain text):
        what is rendered, prompted and shown of a pair where one response is wanted."""
        if self.conversational:
            return Example("chat", messages=self.messages + self.chosen, location=self.location, tools=self.tools,
                           images=self.images)
        return Example("prompt_completion", prompt=self.prompt, completion=self.chosen, location=self.location)


def too_deep(text: str) -> tuple[bool, str]:
    """Whether JSON ``text`` nests deeper than MAX_NESTING, and the top-level field the deep value is in ("" for
    none): read from the brackets outside strings, without parsing (parsing recurses once a level)."""
    if text.count("[") + text.count("{") <= MAX_NESTING:
        return False, ""
    depth, key = 0, ""
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token[0] == '"':
            if depth == 1:
                key = token  # the last string at the top level before a deep value is that value's key
        elif token in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return True, _unquoted(key) if text.lstrip().startswith("{") else ""
        else:
            depth -= 1
    return False, ""


def _unquoted(token: str) -> str:
    try:
        return str(json.loads(token))
    except ValueError:
        return token.strip('"')


def nesting_error(location: str, path: str = "") -> DataError:
    """A value nested deeper than MAX_NESTING, at ``path`` (a field; "": the row itself)."""
    what = path or "the row"
    return DataError(location, f"{what} nests lists or objects more than {MAX_NESTING} levels deep", _NESTING_HINT)


def parse_json(text: str, location: str, path: str) -> Any:
    """The JSON value of ``text`` (a field holding JSON: ``path``); a DataError naming the location and the field for
    text nested too deep (checked before parsing) or not valid JSON."""
    if too_deep(text)[0]:
        raise nesting_error(location, path)
    try:
        return json.loads(text)
    except RecursionError:  # the check above counts brackets; a parser may still give up first
        raise nesting_error(location, path) from None
    except ValueError as exc:
        raise DataError(location, f"{path} is not valid JSON: {exc}") from None


def check_nesting(value: Any, location: str, path: str = "") -> None:
    """Raise a DataError when ``value`` (already read, from Parquet say) nests deeper than MAX_NESTING; walks it
    without recursion."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_NESTING:
            raise nesting_error(location, path)
        if isinstance(item, dict):
            stack += [(child, depth + 1) for child in item.values()]
        elif isinstance(item, (list, tuple)):
            stack += [(child, depth + 1) for child in item]


def detect_format(record: dict) -> str | None:
    """The row format the record's fields point to, or None when they fit none."""
    for fmt, alternatives in _FORMAT_FIELDS.items():
        if any(all(key in record for key in keys) for keys in alternatives):
            return "chat" if fmt == "prompt_completion" and _conversational(record) else fmt
    return None


def _conversational(record: dict) -> bool:
    """A TRL conversational prompt/completion row: the completion is a list of messages."""
    return isinstance(record.get("completion"), list)


def _guess_format(record: dict) -> str | None:
    """A format sharing at least one field with the record: its validation names what is missing."""
    for fmt, alternatives in _FORMAT_FIELDS.items():
        if any(key in record for keys in alternatives for key in keys):
            return fmt
    return None


def to_messages(record: dict, fmt: str, location: str = "") -> Example:
    """Validate one record as ``fmt`` ("auto": detect it) and normalize it into an Example.

    Raises DataError naming the location and the field at the first problem.
    """
    if fmt == "auto":
        fmt = detect_format(record) or _guess_format(record) or ""
    if fmt not in _BUILDERS:
        raise unknown_format_error(record, location)
    example = _BUILDERS[fmt](record, location)
    if example.kind not in IMAGE_FORMATS and has_images(example.messages + _turns(example.completion)):
        raise DataError(location, f"{example.kind} rows with images are not trained yet",
                        "images train in chat rows (supervised fine-tuning) and preference pairs (dpo, simpo) for now")
    if example.kind == "preference" and not example.conversational and record.get("images"):
        raise DataError(location, "field 'images' needs a conversational pair: plain-text prompts have no place for "
                        "images", 'write the prompt as messages whose content holds {"type": "image"} parts')
    return example


def _turns(*responses: Any) -> tuple[dict[str, Any], ...]:
    """The turns among a row's responses (a conversational one's; plain text holds none)."""
    return tuple(turn for response in responses if isinstance(response, tuple) for turn in response)


def fits_no_format(record: dict) -> bool:
    """Whether the record has no field of any row format (``{"foo": ..., "bar": ...}``)."""
    return detect_format(record) is None and _guess_format(record) is None


def unknown_format_error(record: dict, location: str, fmt: str = "auto") -> DataError:
    """A record whose fields fit no row format, its fields named; and what ``fmt`` needs, when one is set."""
    fields = ", ".join(map(str, record)) or "none"
    needs = ""
    if fmt in _FORMAT_FIELDS:
        needs = f": data.format is {fmt}, whose rows need " + " or ".join(map(" and ".join, _FORMAT_FIELDS[fmt]))
    return DataError(location, f"cannot tell the row format from its fields ({fields}){needs}", _FORMAT_HINT)


def _instruction(record: dict, location: str) -> Example:
    instruction = _text(record, "instruction", location)
    extra = _text(record, "input", location, required=False, blank_ok=True)
    output = _text(record, "output", location)
    system = _text(record, "system", location, required=False, blank_ok=True)
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    messages = ({"role": "system", "content": system},) if system.strip() else ()
    messages += ({"role": "user", "content": user}, {"role": "assistant", "content": output})
    return Example("instruction", messages=messages, location=location)


def _chat(record: dict, location: str) -> Example:
    if "messages" not in record and "conversations" not in record and _conversational(record):
        return _conversational_prompt_completion(record, location)
    key = "messages" if "messages" in record else "conversations"
    turns = record.get(key, _MISSING)
    if isinstance(turns, str):  # a CSV cell holding the conversation as JSON
        if too_deep(turns)[0]:
            raise nesting_error(location, f"field '{key}'")
        try:
            turns = json.loads(turns)
        except RecursionError:
            raise nesting_error(location, f"field '{key}'") from None
        except json.JSONDecodeError:
            pass
    if turns is _MISSING:
        raise DataError(location, "field 'messages' is missing", _FORMAT_HINT)
    if not isinstance(turns, list):
        raise DataError(location, f"field '{key}' must be a list of turns, got {describe_value(turns)}")
    if not turns:
        raise DataError(location, f"field '{key}' has no turns")
    messages = tuple(_turn(turn, f"{key}[{index}]", location) for index, turn in enumerate(turns))
    _check_turn_order(messages, key, location)
    messages, images = _with_images(messages, record, key, location)
    return Example("chat", messages=messages, location=location, tools=_tools(record, location), images=images)


def _conversational_prompt_completion(record: dict, location: str) -> Example:
    prompt = record.get("prompt") or []
    if not isinstance(prompt, list):
        raise DataError(location, f"field 'prompt' must be a list of messages like the completion, got {describe_value(prompt)}")
    turns = [(turn, f"prompt[{index}]") for index, turn in enumerate(prompt)]
    turns += [(turn, f"completion[{index}]") for index, turn in enumerate(record["completion"])]
    messages = tuple(_turn(turn, path, location) for turn, path in turns)
    _check_turn_order(messages, "prompt+completion", location)
    messages, images = _with_images(messages, record, "prompt+completion", location)
    return Example("chat", messages=messages, location=location, tools=_tools(record, location), images=images)


def _turn(turn: Any, path: str, location: str) -> dict[str, Any]:
    """One chat turn, OpenAI style (role/content) or ShareGPT style (from/value), with its tool and reasoning
    fields."""
    if not isinstance(turn, dict):
        raise DataError(location, f"{path} must be an object with role and content, got {describe_value(turn)}")
    sharegpt = turn.get("from") is not None and turn.get("role") is None
    role_key, content_key, allowed = ("from", "value", tuple(SHAREGPT_ROLES)) if sharegpt else ("role", "content", ROLES)
    name = turn.get(role_key, _MISSING)
    if name is _MISSING:
        raise DataError(location, f"{path}.{role_key} is missing", f"each turn needs {role_key} and {content_key}")
    role = _ROLE_ALIASES.get(name) if isinstance(name, str) else None
    if role is None:
        raise DataError(location, f"{path}.{role_key} {_short(name)} is not one of {', '.join(allowed)}")
    if sharegpt and name == "function_call":  # LLaMA-Factory: the value is the call (or calls) as JSON
        calls = _tool_calls(turn.get("value"), f"{path}.value", location)
        return {"role": "assistant", "content": "", "tool_calls": calls, **_learned(turn, path, location)}
    calls = turn.get("tool_calls") if role == "assistant" else None
    if isinstance(turn.get(content_key), list):
        content = _parts(turn[content_key], f"{path}.{content_key}", location)
    else:
        content = _text(turn, content_key, location, path=f"{path}.{content_key}", required=calls is None,
                        blank_ok=role in ("system", "tool") or calls is not None)
    message: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if calls is not None:
            message["tool_calls"] = _tool_calls(calls, f"{path}.tool_calls", location)
        message.update(_reasoning(turn, path, location), **_learned(turn, path, location))
    if role == "tool":
        message.update({key: _text(turn, key, location, path=f"{path}.{key}") for key in ("tool_call_id", "name")
                        if turn.get(key) is not None})
    return message


def _parts(parts: list, path: str, location: str) -> str | tuple[dict[str, str], ...]:
    """A content list of text and image parts: its text alone when it holds no image, else the parts (an image
    part keeps the file it names, if it names one, until ``_with_images`` takes it)."""
    read = []
    for index, part in enumerate(parts):
        where = f"{path}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            read.append({"type": "text", "text": _text(part, "text", location, path=f"{where}.text", blank_ok=True)})
        elif kind == "image":
            source = next((part[key] for key in IMAGE_SOURCE_FIELDS if part.get(key) is not None), None)
            if source is not None and not isinstance(source, str):
                raise DataError(location, f"{where} names its image by {describe_value(source)}, not a file path",
                                _IMAGE_HINT)
            read.append({"type": "image", **({"source": source} if source else {})})
        else:
            raise DataError(location, f"{where} must be a text or image part, got {describe_value(part)}",
                            _PARTS_HINT)
    if all(part["type"] == "text" for part in read):
        return "".join(part["text"] for part in read)
    return tuple(read)


def _with_images(messages: tuple[dict[str, Any], ...], record: dict, key: str,
                 location: str) -> tuple[tuple[dict[str, Any], ...], tuple[str, ...]]:
    """The messages with bare image parts, and the files of their images in order: a part's own file, or the next
    of the ``images`` column's."""
    column = _image_column(record, location)
    taken = 0  # of the column's images
    images: list[str] = []
    read = []
    for index, message in enumerate(messages):
        if isinstance(message["content"], str):
            read.append(message)
            continue
        parts = []
        for part_index, part in enumerate(message["content"]):
            if part["type"] == "image":
                where = f"{key}[{index}].content[{part_index}]"
                if message["role"] != "user":
                    raise DataError(location, f"{where} is an image in the {message['role']}'s turn",
                                    "images go in user turns: the model reads them, it does not write them")
                source = part.get("source")
                if source is None and taken == len(column):
                    raise DataError(location, f"{where} is image {len(images)}, but field 'images' lists "
                                    f"{len(column)}", _IMAGE_HINT)
                if source is None:
                    source, taken = column[taken], taken + 1
                images.append(_local_image(source, f"image {len(images)} ({where})", location))
                part = {"type": "image"}
            parts.append(part)
        read.append({**message, "content": tuple(parts)})
    if taken < len(column):
        raise DataError(location, f"field 'images' lists {len(column)} image(s), but the messages' image parts take "
                        f"{taken}", _IMAGE_HINT)
    return tuple(read), tuple(images)


def _image_column(record: dict, location: str) -> list[str]:
    value = record.get("images")
    if value is None or value == []:
        return []
    if not isinstance(value, list) or not all(isinstance(path, str) for path in value):
        raise DataError(location, f"field 'images' must be a list of image file paths, got {describe_value(value)}",
                        _IMAGE_HINT)
    return value


def _local_image(source: str, what: str, location: str) -> str:
    """An image's path as written; a URL is refused (studio trains offline, on local files)."""
    if re.match(r"^[a-z][a-z0-9+.-]*://", source.strip(), re.IGNORECASE) or source.startswith("data:"):
        raise DataError(location, f"{what} is a URL ({_short(source)}): studio reads local image files only "
                        "(offline)", "download the image next to the data file and give its relative path")
    if not source.strip():
        raise DataError(location, f"{what} has an empty path", _IMAGE_HINT)
    return source


def has_images(messages: tuple[dict[str, Any], ...]) -> bool:
    """Whether any message holds an image part (its content is a tuple of parts)."""
    return any(not isinstance(message.get("content", ""), str) for message in messages)


def _reasoning(turn: dict, path: str, location: str) -> dict[str, str]:
    """An assistant turn's reasoning as ``reasoning_content`` (none when it has none)."""
    key = next((key for key in REASONING_FIELDS if turn.get(key) is not None), None)
    reasoning = _text(turn, key, location, path=f"{path}.{key}", blank_ok=True) if key else ""
    return {"reasoning_content": reasoning} if reasoning.strip() else {}


def _learned(turn: dict, path: str, location: str) -> dict[str, bool]:
    """``{"train": False}`` for an assistant turn marked ``train: false`` or ``weight: 0``; else nothing (null, as
    Parquet fills a field other rows have, marks nothing)."""
    train, weight = (turn.get(key) for key in ("train", "weight"))
    train, weight = True if train is None else train, 1 if weight is None else weight
    if not isinstance(train, bool):
        raise DataError(location, f"{path}.train must be true or false, got {describe_value(train)}")
    if isinstance(weight, bool) or weight not in (0, 1):
        raise DataError(location, f"{path}.weight must be 0 or 1, got {describe_value(weight)}",
                        "weight 0 (or train: false) keeps the turn out of the loss")
    return {} if train and weight else {"train": False}


def _json_field(value: Any, path: str, location: str) -> Any:
    """A field's value, JSON text (a CSV cell, LLaMA-Factory's columns) read as JSON; other text as it is."""
    looks_like_json = isinstance(value, str) and value.lstrip()[:1] in ("[", "{")
    return parse_json(value, location, path) if looks_like_json else value


def _tool_calls(value: Any, path: str, location: str) -> list[dict[str, Any]]:
    """An assistant turn's calls in OpenAI's shape, ``{"type": "function", "function": {"name", "arguments"}}``
    (and the call's ``id``), from that shape or LLaMA-Factory's bare ``{"name", "arguments"}``."""
    value = _json_field(value, path, location)
    if isinstance(value, dict):  # LLaMA-Factory's single call
        value = [value]
    if not isinstance(value, list) or not value:
        raise DataError(location, f"{path} must be a list of tool calls, got {describe_value(value)}", _CALL_HINT)
    calls = []
    for index, call in enumerate(value):
        where = f"{path}[{index}]"
        if not isinstance(call, dict):
            raise DataError(location, f"{where} must be an object, got {describe_value(call)}", _CALL_HINT)
        function = call.get("function") or call
        if not _names_function(function):
            raise DataError(location, f"{where} names no function", _CALL_HINT)
        arguments = _json_field(function.get("arguments") or {}, f"{where}.arguments", location)
        if not isinstance(arguments, dict):
            raise DataError(location, f"{where}.arguments must be an object, got {describe_value(arguments)}",
                            _CALL_HINT)
        ids = {"id": call["id"]} if isinstance(call.get("id"), str) else {}
        calls.append({**ids, "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _names_function(function: Any) -> bool:
    """Whether a call or a tool's schema is an object with a function's name (Parquet's nulls aside)."""
    return isinstance(function, dict) and isinstance(function.get("name"), str) and bool(function["name"].strip())


def _tools(record: dict, location: str) -> tuple[dict[str, Any], ...]:
    """The row's ``tools``: JSON schemas of functions, in OpenAI's shape (LLaMA-Factory's bare schemas wrapped)."""
    value = record.get("tools")
    if value is None or value == "":
        return ()
    value = _json_field(value, "field 'tools'", location)
    if not isinstance(value, list):
        raise DataError(location, f"field 'tools' must be a list of JSON schemas of functions, got "
                        f"{describe_value(value)}", _TOOL_HINT)
    tools = []
    for index, tool in enumerate(value):
        function = (tool.get("function") or tool) if isinstance(tool, dict) else None
        if not _names_function(function):
            raise DataError(location, f"field 'tools'[{index}] is not a function's JSON schema (it names no "
                            "function)", _TOOL_HINT)
        if not isinstance(function.get("parameters") or {}, dict):
            raise DataError(location, f"field 'tools'[{index}].parameters must be a JSON schema object, got "
                            f"{describe_value(function['parameters'])}", _TOOL_HINT)
        tools.append({"type": "function", "function": function})
    return tuple(tools)


def _check_turn_order(messages: tuple[dict[str, Any], ...], key: str, location: str) -> None:
    """[system] user assistant (user assistant)...: what every chat template can render and learn from. An
    assistant turn with tool calls is followed by their results (tool turns), then by the assistant again."""
    follows = "start"
    calls: list[dict] = []  # the calls the tool turns now answer
    for index, message in enumerate(messages):
        role, where = message["role"], f"{key}[{index}]"
        if role == "system" and index == 0:
            continue
        if role == "system":
            raise DataError(location, f"{where} is a system turn after the start", "a system turn may only come first")
        if follows == "calls" and role != "tool":
            raise DataError(location, f"{where}: the tool calls of {key}[{index - 1}] get no result",
                            "a tool turn holding each call's result follows the assistant turn that calls")
        if role == "tool":
            if follows not in ("calls", "tool"):
                raise DataError(location, f"{where} is a tool result with no tool call before it",
                                "a tool turn follows the assistant turn whose tool_calls it answers")
            _check_call_id(message, calls, where, location)
        elif role != _EXPECTED[follows]:
            raise DataError(location, f"{where}: {_order_problem(role, follows)}", _ORDER_HINT)
        if message.get("tool_calls"):
            follows, calls = "calls", message["tool_calls"]
        else:
            follows = role
    if follows not in ("assistant", "calls") or len(messages) < 2:
        raise DataError(location, f"field '{key}' does not end with an assistant turn", "the last turn is the response to learn")


_EXPECTED = {"start": "user", "user": "assistant", "assistant": "user", "tool": "assistant"}
"""The role of the turn after each (tool results may also follow one another)."""


def _order_problem(role: str, follows: str) -> str:
    """What is wrong with a ``role`` turn after a ``follows`` one (a key of _EXPECTED), in words."""
    if follows == "start":
        return "the conversation starts with an assistant turn"
    if follows == "tool":
        return "a user turn after tool results: the assistant answers them first"
    return f"two {role} turns in a row"


def _check_call_id(message: dict, calls: list[dict], where: str, location: str) -> None:
    """A tool result's ``tool_call_id`` names one of the calls it answers, when those calls have ids."""
    ids = [call["id"] for call in calls if "id" in call]
    if "tool_call_id" in message and ids and message["tool_call_id"] not in ids:
        raise DataError(location, f"{where}.tool_call_id {_short(message['tool_call_id'])} is not the id of a "
                        f"call it answers ({', '.join(ids)})", "give each tool result the id of its call")


def _prompt_completion(record: dict, location: str) -> Example:
    if _conversational(record):
        raise DataError(location, "the completion is a list of messages: a conversational row, not plain text",
                        "set data.format to chat (or auto)")
    prompt = _text(record, "prompt", location, blank_ok=True)
    completion = _text(record, "completion", location)
    return Example("prompt_completion", prompt=prompt, completion=completion, location=location)


def _plain_text(record: dict, location: str) -> Example:
    return Example("text", text=_text(record, "text", location), location=location)


def _preference(record: dict, location: str) -> Example:
    """A preference pair; its prompt given, or implicit in what chosen and rejected share."""
    for key in ("chosen", "rejected"):
        if key not in record:
            raise DataError(location, f"field '{key}' is missing",
                            "preference rows need prompt (or a shared start), chosen and rejected")
    if isinstance(record["chosen"], list) or isinstance(record["rejected"], list):
        return _conversational_preference(record, location)
    chosen, rejected = _text(record, "chosen", location), _text(record, "rejected", location)
    if "prompt" in record:
        prompt = _text(record, "prompt", location, blank_ok=True)
    else:
        prompt, chosen, rejected = _shared_start(chosen, rejected)
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not value.strip():
            raise DataError(location, f"field '{key}' holds nothing beyond the prompt", "give it a response")
    return Example("preference", prompt=prompt, chosen=chosen, rejected=rejected, location=location)


def _conversational_preference(record: dict, location: str) -> Example:
    turns = {}
    for key in ("prompt", "chosen", "rejected"):
        value = record.get(key, [])
        if not isinstance(value, list):
            raise DataError(location, f"field '{key}' must be a list of messages like the others, got "
                            f"{describe_value(value)}")
        turns[key] = tuple(_turn(turn, f"{key}[{index}]", location) for index, turn in enumerate(value))
    prompt, chosen, rejected = turns["prompt"], turns["chosen"], turns["rejected"]
    if "prompt" not in record:
        prompt, chosen, rejected = _shared_start(chosen, rejected)
    for key, response in (("chosen", chosen), ("rejected", rejected)):
        if not response:
            raise DataError(location, f"field '{key}' holds no turn beyond the prompt", "give it an assistant turn")
        _check_turn_order(prompt + response, f"prompt+{key}", location)
        _with_images(response, {}, key, location)  # an image in an answer is refused as in a chat row's
    prompt, images = _with_images(prompt, record, "prompt", location)
    return Example("preference", messages=prompt, chosen=chosen, rejected=rejected, location=location,
                   tools=_tools(record, location), images=images)


def _unpaired_preference(record: dict, location: str) -> Example:
    """A completion labelled desirable (true) or undesirable (false) after its prompt, as text or turns."""
    label = _label(record, location)
    if isinstance(record.get("completion"), list):
        turns = {}
        for key in ("prompt", "completion"):
            value = record.get(key) or []
            if not isinstance(value, list):
                raise DataError(location, f"field '{key}' must be a list of messages like the completion, got "
                                f"{describe_value(value)}")
            turns[key] = tuple(_turn(turn, f"{key}[{index}]", location) for index, turn in enumerate(value))
        _check_turn_order(turns["prompt"] + turns["completion"], "prompt+completion", location)
        return Example("unpaired_preference", messages=turns["prompt"], completion=turns["completion"], label=label,
                       location=location, tools=_tools(record, location))
    prompt = _text(record, "prompt", location, blank_ok=True)
    completion = _text(record, "completion", location)
    return Example("unpaired_preference", prompt=prompt, completion=completion, label=label, location=location)


def _prompt_only(record: dict, location: str) -> Example:
    """A prompt to answer, text or turns ending with a user turn, and its optional reference answer; a row of
    supervised data (instruction, chat, prompt and completion) is its prompt, its answer the reference."""
    answered = detect_format(record)
    if answered in ANSWERED_FORMATS:
        return _answered_as_prompt(_BUILDERS[answered](record, location), record)
    reference = reference_answer(record)
    if reference is not None and (isinstance(reference, bool) or not isinstance(reference, (str, int, float))):
        column = next(key for key in REFERENCE_COLUMNS if key in record)
        raise DataError(location, f"field '{column}' must be text or a number, got {describe_value(reference)}")
    reference = "" if reference is None else str(reference)
    prompt = record.get("prompt")
    if not isinstance(prompt, list):
        return Example("prompt_only", prompt=_text(record, "prompt", location), reference=reference, location=location,
                       row=record)
    turns = tuple(_turn(turn, f"prompt[{index}]", location) for index, turn in enumerate(prompt))
    if turns and turns[-1]["role"] == "assistant":
        raise DataError(location, "field 'prompt' ends with an assistant turn",
                        "end it with the user's turn: grpo's model writes the answer")
    # the prompt with a stand-in answer is a conversation every template renders, as the model's answer will make it
    _check_turn_order(turns + ({"role": "assistant", "content": ""},), "prompt", location)
    return Example("prompt_only", messages=turns, reference=reference, location=location, row=record,
                   tools=_tools(record, location))


def _answered_as_prompt(example: Example, record: dict) -> Example:
    """A supervised row as GRPO reads it: the turns before its last answer, that answer the reference (unless the
    row has a reference column of its own); the rewards find it in the row as its ``reference`` column."""
    answer = example.completion if example.kind == "prompt_completion" else example.messages[-1]["content"]
    reference = reference_answer(record)
    row = record if reference is not None else {**record, "reference": answer}
    reference = str(answer if reference is None else reference)
    if example.kind == "prompt_completion":
        return Example("prompt_only", prompt=example.prompt, location=example.location, row=row, reference=reference)
    return Example("prompt_only", messages=example.messages[:-1], location=example.location, row=row,
                   tools=example.tools, reference=reference)


def reference_answer(record: dict) -> Any:
    """A row's reference answer: the value of its first ``REFERENCE_COLUMNS`` column (None: it has none)."""
    return next((record[key] for key in REFERENCE_COLUMNS if record.get(key) is not None), None)


def _label(record: dict, location: str) -> bool:
    """An unpaired row's label: true or false (in a CSV file, the text true or false)."""
    value = record.get("label", _MISSING)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        what = "is missing" if value is _MISSING else f"must be true or false, got {describe_value(value)}"
        raise DataError(location, f"field 'label' {what}", "label is true for a desirable completion, false for an "
                        "undesirable one")
    return value


def _shared_start(chosen, rejected):
    """(prompt, chosen, rejected) of an implicit prompt: the longest common start of chosen and rejected, as TRL's
    ``extract_prompt`` cuts it (text: a space before the cut goes with the responses)."""
    cut = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
    if isinstance(chosen, str) and cut and chosen[cut - 1] == " ":
        cut -= 1
    return chosen[:cut], chosen[cut:], rejected[cut:]


_BUILDERS = {"instruction": _instruction, "chat": _chat, "prompt_completion": _prompt_completion, "text": _plain_text,
             "preference": _preference, "unpaired_preference": _unpaired_preference, "prompt_only": _prompt_only}


def _text(record: dict, key: str, location: str, *, path: str = "", required: bool = True,
          blank_ok: bool = False) -> str:
    """The text value of ``record[key]``: missing, null, blank or not-text values are named errors.

    required=False: a missing or null field reads as "". blank_ok: "" and null are allowed.
    """
    path = path or f"field '{key}'"
    value = record.get(key, _MISSING)
    if value is _MISSING:
        if required:
            raise DataError(location, f"{path} is missing")
        return ""
    if value is None:
        if required and not blank_ok:
            raise DataError(location, f"{path} is empty (null)")
        return ""
    if not isinstance(value, str):
        raise DataError(location, f"{path} must be text, got {describe_value(value)}")
    if not blank_ok and not value.strip():
        raise DataError(location, f"{path} is empty", "remove the row or fill it in")
    return value


def describe_value(value: Any) -> str:
    """A user-level description: 'a number (5)', 'a list', 'an object'."""
    if isinstance(value, bool):
        return f"true/false ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, str):
        return f"text {_short(value)}"
    if value is None:
        return "null"
    names = {list: "a list", tuple: "a list", dict: "an object", bytes: "binary data"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
