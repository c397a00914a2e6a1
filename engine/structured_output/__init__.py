"""Structured output with xgrammar: a request's format → a grammar (compiled off the
step loop, cached), a matcher per engine request, and the batch's token bitmask.

``spec`` reads the request fields (OpenAI's ``response_format``, vLLM's ``guided_*`` and
``structured_outputs``) into a hashable :class:`GrammarSpec`; ``compiler`` compiles and
caches them on a worker thread; ``matcher`` holds per-request state and applies the
masks of a whole batch to its logits in one op.
"""

from .spec import GrammarSpec, GrammarSpecError, spec_from_request

__all__ = ["GrammarSpec", "GrammarSpecError", "spec_from_request"]
