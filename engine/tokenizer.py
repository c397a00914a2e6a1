"""The model directory's tokenizer: ``tokenizer.json`` + ``tokenizer_config.json``.

Reads Hugging Face's standard files with the ``tokenizers`` library (no ``transformers``
at serve time) and renders the chat template with jinja2 the way HF does (sandboxed,
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``). BOS/EOS come from
tokenizer_config.json, config.json and generation_config.json, in that order of say.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class TokenizerError(RuntimeError):
    pass


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    def __init__(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")

        self.chat_template: str | None = None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            self.chat_template = template
        elif (model_dir / "chat_template.jinja").exists():
            self.chat_template = (model_dir / "chat_template.jinja").read_text()

        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if self.bos_token_id is None:
            bos = _ids(model_cfg.get("bos_token_id")) or _ids(gen_cfg.get("bos_token_id"))
            self.bos_token_id = bos[0] if bos else None
        eos: set[int] = set()
        if self.eos_token and (tid := self._tok.token_to_id(self.eos_token)) is not None:
            eos.add(tid)
        eos.update(_ids(model_cfg.get("eos_token_id")))
        eos.update(_ids(gen_cfg.get("eos_token_id")))
        self.eos_token_ids = frozenset(eos)
        self.special_token_ids = frozenset(
            tid for tid, added in self._tok.get_added_tokens_decoder().items() if added.special
        )
        self._template_fn: Any = None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Most characters one token can stand for (a vocabulary string's length bounds its
        decoded text: byte-level and metaspace vocabularies spend one char per byte/space).
        ``len(text) / max_token_chars`` is a floor on a text's token count."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long text
        # tokenized on a worker thread does not stall the event loop or the step loop.
        encoded = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoded[0].ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def decode_stream(self, *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self._tok, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render the chat template (tokenize the result with add_special_tokens=False);
        `tools` are the request's tool definitions, as HF templates expect them."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; use /v1/completions")
        if self._template_fn is None:
            self._template_fn = _compile_template(self.chat_template)
        return str(
            self._template_fn.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                tools=tools,
            )
        )


def _compile_template(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template error: {message}")

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=False)

    def strftime_now(fmt: str) -> str:  # used by Llama 3.1+ templates for the date
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return env.from_string(source)


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas (UTF-8 split across tokens is held)."""

    def __init__(self, tok: HFTokenizer, skip_special_tokens: bool) -> None:
        self._tok = tok
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._pending: list[int] = []  # tokens whose bytes are held (incomplete UTF-8)

    def step(self, token_ids: Iterable[int]) -> str:
        out = []
        for token_id in token_ids:
            piece = self._stream.step(self._tok, token_id)
            if piece:
                out.append(piece)
                self._pending.clear()
            else:
                self._pending.append(token_id)
        return "".join(out)

    def flush(self, exclude_last: bool = False) -> str:
        """At the end of a stream: held bytes as text (U+FFFD for what is incomplete), as
        vLLM does rather than dropping them. `exclude_last` leaves out the final token
        (a stop token, whose text is not part of the output)."""
        pending = self._pending[:-1] if exclude_last else self._pending
        self._pending = []
        if not pending:
            return ""
        return str(self._tok.decode(pending, skip_special_tokens=self._skip))
