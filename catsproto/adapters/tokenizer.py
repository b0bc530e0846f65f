"""Prompt to token ids, exactly as a vLLM engine serving the same model directory does.

Strategy. The ingress keys a prompt's blocks before it reaches an engine, so it must see
the very token ids the engine will prefill, or its keys name blocks nobody holds. A model
directory carries both halves of that: ``tokenizer.json`` (the `tokenizers` package's
fast path, the one vLLM's Hugging Face tokenizer wraps) and ``tokenizer_config.json`` (the
chat template and the special tokens the template may name). Nothing is downloaded.

* A completion's text prompt is encoded the way vLLM encodes it: with the tokenizer's own
  post-processor (``add_special_tokens=True``: a BOS where the tokenizer.json says so,
  none where it does not). A prompt given as token ids is taken as it is.
* A chat is first rendered the way vLLM 0.32 renders it (``renderers/chat_utils.py`` and
  ``renderers/hf.py``, over transformers' ``render_jinja_template``): each message's
  content, a string or a list of text parts, becomes one string (text parts joined with
  ``"\\n"``, the "string" content format) unless the template itself loops over the
  parts (the "openai" format: the parts go in as ``{"type": "text", "text": ...}``);
  ``developer`` turns become ``system`` turns when the template does not name that role;
  then the template runs in jinja2's immutable sandbox with ``trim_blocks`` and
  ``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``, ``tools``,
  ``documents``, the special tokens (``bos_token``, ``eos_token``, ...) and the request's
  ``chat_template_kwargs``; the text is encoded with ``add_special_tokens=False``.

A prompt longer than the model's context (``max_position_embeddings`` in the model
directory's ``config.json``, vLLM's default ``max_model_len``) is refused, and the
refusal costs little: no token covers more text than the longest entry of the
vocabulary (`max_token_bytes`, its UTF-8 length), so a text of more than
``max_tokens * max_token_bytes`` bytes has more tokens than the context holds and is
refused before it is tokenized; a list of token ids is measured before its ids are
checked. (A tokenizer whose normalizer deletes characters could fit such a text into
the context; such a prompt, megabytes of what the model would never see, is refused.)

OpenAI lets a completion carry a batch (a list of strings, a list of token-id lists). One
request is steered to one instance, so the ingress takes one prompt per request: a
one-element batch is that prompt, a longer one is refused (`PromptError`, a 400).
Multimodal parts are refused the same way: the ingress keys text only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = ["PromptError", "PromptTokenizer"]

# content part types vLLM reads as text, and the field each keeps its text in
TEXT_PART_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# the special tokens transformers hands a chat template (its special_tokens_map)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, same spelling
_BILLING_HEADER = "x-anthropic-billing-header"  # a system line vLLM drops (cache-busting)
MAX_TOKEN_ID = (1 << 32) - 1


class PromptError(ValueError):
    """A prompt or chat the ingress cannot tokenize; `param` names the request field,
    `code` the case when it has one of its own (OpenAI's ``context_length_exceeded``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


CONTEXT_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt over the context


def model_context(model_dir: Path) -> int | None:
    """The model's context in tokens: ``max_position_embeddings`` of its config.json
    (None without one)."""
    path = model_dir / "config.json"
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON: {exc}") from None
    value = config.get("max_position_embeddings") if isinstance(config, dict) else None
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise ValueError(f"{path}: max_position_embeddings {value!r} is not a token count")
    return value


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag):
    rendered as its body, as transformers does when no mask is asked for."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson` filter: no HTML escaping, JSON's own options."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _is_content_access(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """`node` is ``m['content']`` or ``m.content`` for a message variable `m`."""
    if isinstance(node, jinja2.nodes.Getitem):
        key = node.arg
        ok = isinstance(key, jinja2.nodes.Const) and key.value == "content"
    elif isinstance(node, jinja2.nodes.Getattr):
        ok = node.attr == "content"
    else:
        return False
    return ok and isinstance(node.node, jinja2.nodes.Name) and node.node.name in names


def content_format(env: jinja2.Environment, template: str) -> str:
    """The content format: "openai" if the template loops over a message's content
    (then it gets the parts as dicts), else "string" (vLLM's `_detect_content_format`,
    without its macro and variable-alias cases: those templates get "string" here)."""
    try:
        ast = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    loops = list(ast.find_all(jinja2.nodes.For))
    message_vars = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, jinja2.nodes.Name)
        and isinstance(loop.iter, jinja2.nodes.Name)
        and loop.iter.name == "messages"
    }
    for loop in loops:
        if _is_content_access(loop.iter, message_vars):
            return "openai"
        if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content":
            return "openai"
    return "string"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class PromptTokenizer:
    """One model directory's tokenizer and chat template (`completion_ids`, `chat_ids`)."""

    def __init__(self, model_dir: str | Path, max_tokens: int | None = None) -> None:
        """`max_tokens`: the longest prompt taken (None: the model's context,
        `model_context`; no bound when config.json does not say it)."""
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise ValueError(f"{path}: cannot load a tokenizer: {exc}") from None
        config_path = self.model_dir / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.exists():
            config = json.loads(config_path.read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ValueError(f"{config_path}: not a JSON object")
        self.special_tokens = {
            name: text
            for name in SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            self.special_tokens["additional_special_tokens"] = [
                t for t in map(_token_text, extra) if t is not None
            ]
        self.chat_template = self._template(config)
        self._env = _environment()
        self._compiled = (
            self._env.from_string(self.chat_template) if self.chat_template is not None else None
        )
        self.content_format = (
            content_format(self._env, self.chat_template) if self.chat_template else "string"
        )
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        # the most text one token covers: UTF-8 of its vocabulary entry, which is never
        # shorter than the input it stands for (a byte-level or "▁" entry is longer)
        self.max_token_bytes = max((len(piece.encode()) for piece in vocab), default=1)
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens if max_tokens is not None else model_context(self.model_dir)
        self._fast = hasattr(self.tokenizer, "encode_batch_fast")  # tokenizers >= 0.21

    def _template(self, config: dict[str, Any]) -> str | None:
        """The default chat template: chat_template.jinja (transformers 5 saves it
        there), else tokenizer_config.json's (a string, or named ones: "default")."""
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.exists():
            return jinja_file.read_text(encoding="utf-8")
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    # ---- completions ------------------------------------------------------------------

    def completion_ids(self, prompt: Any) -> list[int]:
        """A completion request's ``prompt`` as token ids: a string encoded as vLLM
        encodes it, a list of token ids as it is, a batch of one as its one prompt."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self._encode(prompt, True, "prompt")
        if isinstance(prompt, list):
            if prompt and all(isinstance(p, str | list) for p in prompt):
                raise PromptError(
                    f"prompt: a batch of {len(prompt)} prompts; the ingress steers one "
                    "prompt per request (send them as separate requests)",
                    "prompt",
                )
            self._within_context(len(prompt), "prompt", "token ids")
            return token_ids(prompt, "prompt")
        raise PromptError(
            "prompt must be a string or a list of token ids (one prompt per request)", "prompt"
        )

    # ---- chat ---------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
    ) -> str:
        """The chat as the text the template renders (what vLLM tokenizes)."""
        if self._compiled is None:
            raise PromptError(
                f"{self.model_dir}: the tokenizer has no chat template: use /v1/completions",
                "messages",
            )
        if continue_final_message and add_generation_prompt:
            raise PromptError(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        conversation = self.conversation(messages)
        kwargs = dict(chat_template_kwargs or {})
        for reserved in ("chat_template", "tokenize"):
            if reserved in kwargs:
                raise PromptError(
                    f"chat_template_kwargs may not set {reserved!r}", "chat_template_kwargs"
                )
        final: str | None = None
        if continue_final_message:
            last = conversation[-1]
            final = last.get("content")
            if not isinstance(final, str):
                raise PromptError(
                    "continue_final_message: the last message has no text to continue",
                    "messages",
                )
            last["content"] = final + _CONTINUE_TAG
        variables = {
            **self.special_tokens,
            **kwargs,
            "messages": conversation,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self._compiled.render(**variables)
        except jinja2.TemplateError as exc:
            raise PromptError(
                f"the chat template refused the messages: {exc}", "messages"
            ) from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise PromptError(
                f"the chat template failed on the messages: {type(exc).__name__}: {exc}",
                "messages",
            ) from None
        if final is not None:  # transformers' cut at the marker
            at = text.rindex(_CONTINUE_TAG.strip())
            if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                text = text[:at]
            else:
                text = text[:at].rstrip()
        return text

    def chat_ids(self, messages: Any, **options: Any) -> list[int]:
        """A chat as token ids: rendered (`render_chat`), encoded without special tokens."""
        return self._encode(self.render_chat(messages, **options), False, "messages")

    def _within_context(self, tokens: int, param: str, what: str = "tokens") -> None:
        if self.max_tokens is not None and tokens > self.max_tokens:
            raise PromptError(
                f"{param}: {tokens} {what}, over the model's context of {self.max_tokens} tokens",
                param,
                CONTEXT_EXCEEDED,
            )

    def _encode(self, text: str, special: bool, param: str) -> list[int]:
        """Token ids of `text` (the fast path without offsets where tokenizers has it);
        a text too long for the context is refused before it is tokenized."""
        if self.max_tokens is not None:
            most = self.max_tokens * self.max_token_bytes
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > most:
                raise PromptError(
                    f"{param}: {size} bytes of text are more than {self.max_tokens} tokens "
                    f"(the model's context; no token covers more than "
                    f"{self.max_token_bytes} bytes)",
                    param,
                    CONTEXT_EXCEEDED,
                )
        if self._fast:
            ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids
        else:
            ids = self.tokenizer.encode(text, add_special_tokens=special).ids
        self._within_context(len(ids), param)
        return ids

    def conversation(self, messages: Any) -> list[dict[str, Any]]:
        """The messages as the template sees them (vLLM's `parse_chat_messages`, text)."""
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list of messages", "messages")
        out: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise PromptError(f"messages[{i}] must be an object with a string role", "messages")
            out.append(self._message(i, message))
        if any(m["role"] == "developer" for m in out) and not _names_developer(
            self.chat_template or ""
        ):
            out = _developer_as_system(out)
        return out

    def _message(self, i: int, message: dict[str, Any]) -> dict[str, Any]:
        role = message["role"]
        content = message.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = content
        else:
            raise PromptError(
                f"messages[{i}].content must be a string, a list of parts or null", "messages"
            )
        if role == "system":
            parts = _without_billing_header(parts)
        texts = [_part_text(i, j, part) for j, part in enumerate(parts)]
        texts = [t for t in texts if t is not None]
        if self.content_format == "openai":
            body: Any = [{"type": "text", "text": t} for t in texts]
        else:
            body = "\n".join(texts)
        out: dict[str, Any] = {"role": role, "content": body}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                out["tool_calls"] = [_tool_call(c) for c in calls]
            if message.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = message["reasoning"]
        elif role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                out[key] = message[key]
        if role == "developer":
            out["tools"] = message.get("tools")
        return out


def token_ids(raw: Any, param: str) -> list[int]:
    """A list of token ids, checked: integers 0..2^32-1 (JSON's true/false are not)."""
    if not isinstance(raw, list) or not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in raw):
        raise PromptError(f"{param} must be a list of token ids (integers 0..2^32-1)", param)
    return raw


def _part_text(i: int, j: int, part: Any) -> str | None:
    """A content part's text (None: a text part without text, skipped as vLLM does)."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        kind = part.get("type")
        field = TEXT_PART_FIELDS.get(kind) if isinstance(kind, str) else None
        if field is not None:
            text = part.get(field)
            if text is None or isinstance(text, str):
                return text
            raise PromptError(f"messages[{i}].content[{j}].{field} must be a string", "messages")
        raise PromptError(
            f"messages[{i}].content[{j}]: part type {kind!r} is not text; the ingress "
            f"keys text parts only ({', '.join(sorted(TEXT_PART_FIELDS))})",
            "messages",
        )
    raise PromptError(f"messages[{i}].content[{j}] must be a string or an object", "messages")


def _without_billing_header(parts: Sequence[Any]) -> list[Any]:
    """vLLM drops a system part's first line when it is Claude Code's billing header."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _tool_call(call: Any) -> Any:
    """An assistant tool call with its arguments as a dict (vLLM's post-processing)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    args = function.get("arguments")
    if isinstance(args, str) and args:
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = {}
        function["arguments"] = parsed if isinstance(parsed, dict) else {}
    elif not isinstance(args, dict):
        function["arguments"] = {}
    return {**call, "function": function}


def _names_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's `_convert_developer_to_system` then `_consolidate_system_messages`."""
    converted = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        converted.append(m)
    systems: list[str] = []
    rest = []
    consolidate = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            rest.append(m)
            continue
        if i > 0 or systems:
            consolidate = True
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and "text" in p)
        if content:
            systems.append(content)
    if not consolidate:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *rest]
