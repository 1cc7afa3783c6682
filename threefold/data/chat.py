"""Chat templates: conversations (lists of ``{"role", "content"}`` messages) to text, and text
to token ids with a mask of the tokens the model is trained on.

Which template renders a conversation (``load_chat_template``):

- the tokenizer's own, when a ``tokenizer_config.json`` next to its ``tokenizer.json`` has a
  ``chat_template`` (or a ``chat_template.jinja`` file sits there), as Hugging Face folders
  ship them. It is a Jinja template, rendered with the optional ``jinja2`` package the way
  ``transformers`` renders it (sandboxed, ``trim_blocks``, ``lstrip_blocks``; ``messages``,
  ``add_generation_prompt`` and the special-token strings in scope);
- otherwise the built-in template, which needs nothing beyond the tokenizer's end-of-text
  token. Each message becomes::

      <|{role}|>\\n{content}{EOT}

  one after another with nothing between them, where ``{EOT}`` is the tokenizer's end-of-text
  token (``<|endoftext|>`` for threefold's BPE; the first of ``threefold.data.tokenizer.
  EOT_NAMES`` the tokenizer has). The generation prompt is ``<|assistant|>\\n``. ``<|user|>``
  and the other role markers are plain text (several ordinary tokens), not special tokens.
  ``BUILTIN_TEMPLATE`` is the same format as a Jinja template, with ``{% generation %}``
  marks; SFT and DPO runs save the template they used as ``chat_template.jinja`` in their
  output directory, so a run started from them uses it again (a saved built-in template is
  rendered in Python, without jinja2).

Trained tokens are found without ``{% generation %}`` marks, so any template that renders a
conversation prefix as a prefix of the whole works: an assistant message ``i`` spans the
characters from the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
``render(messages[:i + 1])``, i.e. its content and whatever the template closes the turn with
(the end-of-text token of the built-in template, which teaches the model to stop). The whole
conversation is tokenized once and a token is trained when its characters overlap such a span,
which is how ``transformers`` turns ``{% generation %}`` spans into its assistant mask. Text
in a message that spells a special token (``<|endoftext|>``) becomes that token, as it does in
``transformers``' chat templating.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tokenizers import Tokenizer

from threefold.data.errors import DataError
from threefold.data.tokenizer import eot_id

GENERATION_PROMPT = "<|assistant|>\n"
# The built-in format as a Jinja chat template (transformers' dialect): what
# ``BuiltinTemplate.render`` writes, character for character (a test checks it).
BUILTIN_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
    "{{ eos_token }}{% endgeneration %}{% else %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def eot_token(tok: Tokenizer, where: str = "tokenizer") -> str:
    """The end-of-text token's text (``<|endoftext|>`` for threefold's BPE)."""
    return tok.id_to_token(eot_id(tok, where))


class BuiltinTemplate:
    """The documented built-in format (see the module docstring), in plain Python."""

    source = "builtin"
    text = BUILTIN_TEMPLATE  # the same format in Jinja, saved next to a trained model

    def __init__(self, eot: str):
        self.eot = eot

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """``<|role|>\\n{content}{EOT}`` per message, then the generation prompt if asked."""
        text = "".join(f"<|{m['role']}|>\n{m['content']}{self.eot}" for m in messages)
        return text + (GENERATION_PROMPT if add_generation_prompt else "")


class JinjaTemplate:
    """A Hugging Face chat template rendered with jinja2 as ``transformers`` does."""

    def __init__(self, template: str, special: dict[str, str], source: str):
        try:  # here, not at the top: jinja2 is optional (the built-in template needs none)
            from jinja2 import nodes
            from jinja2.ext import Extension
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise DataError(f"{source}: this tokenizer's chat template needs the jinja2 package "
                            "(pip install jinja2), or pass --sft.chat_template builtin / "
                            "--dpo.chat_template builtin") from None

        class GenerationTag(Extension):
            """``{% generation %}...{% endgeneration %}``: renders its body unchanged (trained
            spans are found by rendering prefixes, see the module docstring)."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.Scope(body, lineno=lineno)

        def raise_exception(message: str):
            raise DataError(f"{source}: the chat template refused a conversation: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent,
                                                                       ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(template)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise DataError(f"{source}: chat template is not valid Jinja ({e})") from None
        self.special, self.source, self.text = special, source, template

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``."""
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.special)


ChatTemplate = BuiltinTemplate | JinjaTemplate


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_template(folder: Path) -> tuple[str, dict[str, str], str] | None:
    """(template, special-token strings, where) from a tokenizer folder, if it has one."""
    cfg_path = folder / "tokenizer_config.json"
    conf: dict = {}
    if cfg_path.is_file():
        try:
            conf = json.loads(cfg_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise DataError(f"{cfg_path}: not valid JSON ({e})") from None
    special = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
               if (t := _token_text(conf.get(k))) is not None}
    template, where = conf.get("chat_template"), str(cfg_path)
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not template and (folder / "chat_template.jinja").is_file():
        template, where = (folder / "chat_template.jinja").read_text(encoding="utf-8"), \
            str(folder / "chat_template.jinja")
    return (template, special, where) if isinstance(template, str) and template else None


def load_chat_template(tokenizer_path: str | Path, tok: Tokenizer,
                       choice: str = "auto") -> ChatTemplate:
    """The template for ``choice``: "auto" (the tokenizer folder's, else the built-in one),
    "builtin", or the path of a Jinja template file."""
    if choice == "auto":
        found = _hf_template(Path(tokenizer_path).expanduser().parent)
        if found is not None and found[0] != BUILTIN_TEMPLATE:  # (a saved built-in: below)
            template, special, where = found
            # a folder's own template names its tokens; the end-of-text token is only a
            # default for ``eos_token``, so a tokenizer without one can still chat
            if "eos_token" not in special:
                special["eos_token"] = eot_token(tok, str(tokenizer_path))
            return JinjaTemplate(template, special, where)
    eot = eot_token(tok, str(tokenizer_path))
    if choice in ("builtin", "auto"):
        return BuiltinTemplate(eot)
    path = Path(choice).expanduser()
    if not path.is_file():
        raise DataError(f"chat template '{choice}' is neither 'auto', 'builtin' nor a file")
    return JinjaTemplate(path.read_text(encoding="utf-8"), {"eos_token": eot}, str(path))


def end_of_turn(template: ChatTemplate, tok: Tokenizer) -> int | None:
    """The special token ``template`` closes an assistant turn with (``<|im_end|>`` for
    ChatML, the end-of-text token for the built-in template), found by rendering a reply and
    tokenizing what follows it: the token generation stops at. None if nothing special
    follows the reply or the template refuses the probe conversation."""
    reply = "threefold end-of-turn probe"
    try:
        text = template.render([{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": reply}])
    except DataError:
        return None
    if reply not in text:
        return None
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    tail = encode_text(tok, text[text.rindex(reply) + len(reply):]).ids
    return next((i for i in tail if i in special), None)


# --------------------------------------------------------------------------------------------
# Records and encoding
# --------------------------------------------------------------------------------------------
def announce(run, template: ChatTemplate, head: str, stats: dict, dropped_why: str) -> None:
    """On the writer rank: print ``head`` followed by how many examples were truncated or
    dropped (and why), and give the run the chat template to save as ``chat_template.jinja``
    in its directory (``Run.outputs``), next to the tokenizer.json the loop copies there: a
    run started from this one (``checkpoint.init_from``) then renders conversations the same
    way, and ``transformers`` reads the file from a Hugging Face folder that holds it."""
    if not run.world.is_writer:
        return
    run.outputs["chat_template.jinja"] = template.text
    print(head + (f", {stats['truncated']} truncated" if stats.get("truncated") else "")
          + (f", {stats['dropped']} dropped ({dropped_why})" if stats.get("dropped") else ""),
          flush=True)


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, record) for every non-blank line; DataError naming the line if one is
    not a JSON object."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DataError(f"cannot read '{path}': {e.strerror or e}") from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{no}: not valid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise DataError(f"{path}:{no}: expected a JSON object, got {type(rec).__name__}")
        out.append((no, rec))
    if not out:
        raise DataError(f"'{path}' holds no records")
    return out


def check_messages(messages: Any, where: str, need_assistant: bool = True) -> list[dict]:
    """``messages`` if it is a list of {"role": str, "content": str}; DataError else."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of "
                        "{\"role\": ..., \"content\": ...} objects")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: message {i} is not an object with string 'role' and "
                            f"'content': {json.dumps(m)[:80]}")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant message, so nothing "
                        "would be trained on it")
    return messages


@dataclass
class Encoded:
    """Token ids of a rendered conversation and which of them are trained."""

    ids: list[int]
    trained: list[bool]


def encode_text(tok: Tokenizer, text: str):
    """Token ids and character offsets of ``text``; special-token strings in it are special
    tokens, nothing is added around it (chat templates carry their own markers)."""
    return tok.encode(text, add_special_tokens=False)


def assistant_spans(render: Callable[..., str], messages: list[dict],
                    where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn."""
    full = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], add_generation_prompt=True)
        upto = render(messages[:i + 1])
        if not (upto.startswith(before) and full.startswith(upto)):
            raise DataError(f"{where}: the chat template does not render the conversation up to "
                            f"message {i} as a prefix of the whole, so the assistant's tokens "
                            "cannot be told apart; use --sft.chat_template builtin or a "
                            "template without that behaviour")
        spans.append((len(before), len(upto)))
    return full, spans


def encode_conversation(template: ChatTemplate, tok: Tokenizer, messages: list[dict],
                        where: str = "conversation") -> Encoded:
    """Render and tokenize ``messages``; trained = the tokens of the assistants' turns."""
    full, spans = assistant_spans(template.render, messages, where)
    enc = encode_text(tok, full)
    trained = [any(s < b and e > a for a, b in spans) for s, e in enc.offsets]
    return Encoded(list(enc.ids), trained)
