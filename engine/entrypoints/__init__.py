"""The OpenAI-compatible HTTP front end, laid out as vLLM's ``entrypoints/openai``.

``api_server`` builds the app and its routes; one serving class per API
(``serving_completion``, ``serving_chat``, ``serving_tokenization``, ``serving_models``)
holds that API's logic on top of :class:`~.serving_engine.OpenAIServing` (body parsing,
tokenizing, sampling parameters), and ``responses`` is the one response-assembly path
(whole JSON or SSE) that completions and chat share.
"""
