"""Grammar compilation: cached by the grammar, done on a worker thread.

A request with a grammar awaits its compile here, before it reaches the engine, so the
step loop never waits on a compile and other requests keep stepping. Identical grammars
share one compile (in flight or done) through an LRU of futures keyed by
:attr:`GrammarSpec.key`; a failed compile is not cached.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import TYPE_CHECKING, Any

from infergate.engine.tokenizer import Tokenizer

from .spec import GrammarSpec, GrammarSpecError

if TYPE_CHECKING:
    import xgrammar as xgr

CACHE_SIZE = 256
#: ``json_object`` means "a JSON object" (OpenAI's JSON mode, LangChain's ``json_mode``):
#: xgrammar's built-in JSON grammar would also admit an array, a string or a number at the
#: top level, so it is compiled as the schema of any object, as vLLM does.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] /path/x.cc:83: "


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, from ``tokenizer.json`` alone (no transformers).

    ``vocab_size`` is the model's logits width (>= the tokenizer's): ids without a token
    string are never allowed by any grammar.
    """
    import xgrammar as xgr

    backend = tokenizer.backend
    encoded = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            encoded[index] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=meta["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=sorted(tokenizer.eos_token_ids) or None,
        add_prefix_space=meta["add_prefix_space"],
    )


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _message(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return _XGR_PREFIX.sub("", text)


class GrammarCompiler:
    """Compiles :class:`GrammarSpec` s for one tokenizer; thread-safe, cached.

    xgrammar is imported, and its view of the vocabulary built, at the first compile (as
    vLLM starts its structured-output backend at the first request that asks for one):
    a server that is never asked for structured output does not hold its ~44 MiB.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_workers: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_workers = max_workers
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], asyncio.Future[Any]] = OrderedDict()
        self.compiles = 0  # actual compiles (cache misses), for tests and metrics

    @cached_property
    def info(self) -> xgr.TokenizerInfo:
        return tokenizer_info(self.tokenizer, self.vocab_size)

    @cached_property
    def _compiler(self) -> xgr.GrammarCompiler:
        import xgrammar as xgr

        # xgrammar keeps its own cache too; ours also dedups compiles in flight.
        return xgr.GrammarCompiler(self.info, max_threads=self.max_workers)

    def compile_sync(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compile now, on the calling thread; a bad grammar is a GrammarSpecError."""
        self.compiles += 1
        try:
            if spec.kind == "json":
                return self._compiler.compile_json_schema(spec.value, any_whitespace=False)
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.value)
            if spec.kind == "structural_tag":
                return self._compiler.compile_structural_tag(spec.value)
            if spec.kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(json.loads(spec.value)))
            return self._compiler.compile_grammar(spec.value)
        except (RuntimeError, ValueError, TypeError) as error:
            raise GrammarSpecError(spec.param, f"Invalid {spec.param}: {_message(error)}") from None

    async def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec`, from the cache or compiled off the event loop."""
        future = self._cache.get(spec.key)
        if future is not None:
            self._cache.move_to_end(spec.key)
        else:
            loop = asyncio.get_running_loop()
            future = asyncio.ensure_future(
                loop.run_in_executor(self._pool, self.compile_sync, spec)
            )
            self._cache[spec.key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        try:
            return await asyncio.shield(future)
        except GrammarSpecError:
            if self._cache.get(spec.key) is future:
                del self._cache[spec.key]
            raise

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
