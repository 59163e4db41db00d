"""How `pagedkv serve` renders chats and reads tool calls (vLLM's flags): ``--chat-template``,
``--trust-request-chat-template``, ``--enable-auto-tool-choice`` and ``--tool-call-parser``.

::

    options = ChatOptions.from_cli_args(args)     # or ChatOptions(tool_call_parser="hermes", ...)
    app = create_app(loop, model_name=name, chat_options=options)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser
from pagedkv.errors import ConfigError

#: A ``--chat-template`` value with one of these characters is a template, not a file name
#: (vLLM's rule).
_TEMPLATE_CHARS = frozenset("{}\n")


def load_chat_template(value: str) -> str:
    """A ``--chat-template`` value -> the template's text: the file it names, or the value itself
    when it holds ``{``, ``}`` or a newline (an inline template).

    Raises:
        ConfigError: a file name that does not exist or cannot be read, or an empty template.
    """
    if _TEMPLATE_CHARS & set(value):
        return value
    path = Path(value).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"--chat-template {value!r}: not a readable file ({e}); an inline template must "
            "contain {{ }} or a newline"
        ) from None
    if not text.strip():
        raise ConfigError(f"--chat-template {value!r}: the file is empty")
    return text


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """The server's chat options.

    Args:
        chat_template: the Jinja template text used instead of the model's (None: the model's;
            :func:`load_chat_template` reads ``--chat-template``).
        trust_request_chat_template: accept a request's own ``chat_template`` (off: a 400, as
            vLLM; a template is code the server runs, in Jinja's sandbox).
        enable_auto_tool_choice: serve ``tool_choice: "auto"`` (needs ``tool_call_parser``).
        tool_call_parser: how tool calls are read from the output, a name of
            :data:`~.tool_parsers.TOOL_PARSERS` (``hermes``, ``llama3_json``).

    Raises:
        ConfigError: an unknown parser, or auto tool choice without a parser.
    """

    chat_template: str | None = None
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(
                f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                f"{self.tool_call_parser!r}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ConfigError("--chat-template is empty")

    @property
    def parser(self) -> ToolParser | None:
        """The tool-call parser, None when auto tool choice is off."""
        if not self.enable_auto_tool_choice or self.tool_call_parser is None:
            return None
        return get_tool_parser(self.tool_call_parser)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser | Any) -> None:
        """Add the four flags to ``parser`` (an ArgumentParser or an argument group)."""
        parser.add_argument(
            "--chat-template",
            default=None,
            metavar="FILE_OR_TEMPLATE",
            help="Jinja chat template (a file, or the template itself) used instead of the "
            "model's; examples/tool_chat_template_hermes.jinja renders tools for models whose "
            "own template does not (SmolLM2)",
        )
        parser.add_argument(
            "--trust-request-chat-template",
            action="store_true",
            help="accept a request's own chat_template (default: refused with a 400)",
        )
        parser.add_argument(
            "--enable-auto-tool-choice",
            action="store_true",
            help='serve tool_choice "auto": tool calls are read from the output by '
            "--tool-call-parser",
        )
        parser.add_argument(
            "--tool-call-parser",
            default=None,
            choices=tuple(TOOL_PARSERS),
            help="the format of the model's tool calls: hermes (<tool_call>{...}</tool_call>: "
            "Hermes, Qwen, our example template) or llama3_json",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ChatOptions:
        """The options from parsed :meth:`add_cli_args` flags (the template file read).

        Raises:
            ConfigError: see the class and :func:`load_chat_template`.
        """
        template = None if args.chat_template is None else load_chat_template(args.chat_template)
        return cls(
            chat_template=template,
            trust_request_chat_template=bool(args.trust_request_chat_template),
            enable_auto_tool_choice=bool(args.enable_auto_tool_choice),
            tool_call_parser=args.tool_call_parser,
        )
