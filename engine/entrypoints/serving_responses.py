"""``/v1/responses``: OpenAI's Responses API over the chat path, with a response store.

A request's items become chat messages (:mod:`.responses_input`), so the chat template,
the tool parsers and xgrammar serve it unchanged; one engine request generates it; an
:class:`~.responses_output.OutputBuilder` turns its outputs into output items and stream
events. With ``store`` (the default, as OpenAI's) the response is kept in a bounded
:class:`~.response_store.ResponseStore` while it runs and after, which serves
``previous_response_id``, ``GET /v1/responses/{id}`` and cancelling a running response.

Response ids carry a route tag (:mod:`infergate.wire.responses`): the one the EPP sent in
``x-infergate-route-tag``, else this engine's own, so an EPP can send the next turn back.
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from infergate.engine.entrypoints.protocol import ChatMessage, _Sampling
from infergate.engine.entrypoints.protocol_responses import (
    Item,
    ItemError,
    ResponsesRequest,
    parse_items,
    unsupported_fields,
)
from infergate.engine.interfaces import SamplingParams
from infergate.engine.tool_parsers.choice import ToolChoiceError, ToolPlan, plan_tools
from infergate.engine.tool_parsers.stream import ToolCallState

from infergate.wire.responses import ROUTE_TAG_HEADER, make_response_id, valid_tag

from .errors import APIError
from .response_store import ResponseStore, StoredResponse
from .responses import sse
from .responses_input import chat_tool_choice, chat_tools, grammar_spec, to_messages
from .responses_run import ResponseRun
from .serving_engine import OpenAIServing, run_to_end

#: Errors of the shared sampling checks, renamed to the Responses field they concern.
_PARAM_NAMES = {"max_tokens": "max_output_tokens", "prompt": "input", "messages": "input"}


class OpenAIServingResponses(OpenAIServing):
    """Create, retrieve and cancel responses; ``store`` is None when the store is off."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.store = (
            ResponseStore(cfg.responses_store_max_entries, cfg.responses_store_ttl_s)
            if cfg.responses_store
            else None
        )
        self.route_tag = cfg.route_tag

    # -- create ------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        req = await self.parse_request(request, ResponsesRequest)
        model = self.check_model(req.model)
        self.check_fields(req)
        previous = self.previous(req, model)
        items, history = self.items(req, previous)
        plan = self.tool_plan(req)
        ids = await self.render(to_messages(req.instructions, [*history, *items]), plan)
        sampling = _sampling(req)
        order = self.queue_order(request, sampling)
        params = self.params(sampling, len(ids), req.max_output_tokens)
        grammar = await self.compile_grammar(
            self.tool_grammar(grammar_spec(req.text.format if req.text is not None else None), plan)
        )
        rid = make_response_id(self.tag_for(request))
        if self.metrics is not None:
            self.metrics.request_accepted(1, params.max_tokens)
        engine_request = self.new_request(rid, ids, params, sampling, grammar, order)
        run = ResponseRun(self.base_object(rid, req, model, params.temperature, params.top_p),
                          ToolCallState(plan, self.tool_parser()), len(ids))  # fmt: skip
        stored = [*(previous.conversation() if previous else []), *items_dump(items)]
        entry = self.remember(rid, req, model, run, stored)
        events = run.events(self.engine.generate(engine_request), entry, self.store)
        if req.stream:
            return StreamingResponse(_sse(events), media_type="text/event-stream")
        return await _whole(request, run, events)

    def items(self, req: ResponsesRequest,
              previous: StoredResponse | None) -> tuple[list[Item], list[Item]]:  # fmt: skip
        """(the new input items, the previous conversation's items), validated."""
        try:
            items = parse_items(req.input)
            stored = previous.conversation() if previous is not None else []
            return items, parse_items(stored, "previous_response_id")
        except ItemError as error:
            raise APIError(400, error.message, error.param) from None

    async def render(self, messages: list[ChatMessage], plan: ToolPlan) -> list[int]:
        """The prompt's token ids (the chat template over the conversation)."""
        with _responses_params():
            text = self.chat_text(messages, True, plan.template_tools())
            return await self.encode(text, add_special_tokens=False)

    def params(
        self, sampling: _Sampling, prompt_len: int, max_output: int | None
    ) -> SamplingParams:
        with _responses_params():
            return self.sampling_params(sampling, prompt_len, max_output, None)

    def check_fields(self, req: ResponsesRequest) -> None:
        """Known fields the engine cannot honour, and ``store`` on an engine without one."""
        problem = unsupported_fields(req)
        if problem is not None:
            raise APIError(400, f"{problem[1]}.", problem[0])
        if self.store is None and "store" in req.model_fields_set and req.store:
            raise APIError(400, "store=true: the response store is disabled on this engine "
                           "(--no-enable-responses-api-store).", "store")  # fmt: skip

    def previous(self, req: ResponsesRequest, model: str) -> StoredResponse | None:
        """The stored response ``previous_response_id`` names: 404 unknown, 400 other model."""
        rid = req.previous_response_id
        if rid is None:
            return None
        entry = self.store.get(rid) if self.store is not None else None
        if entry is None:
            raise APIError(404, f"Previous response with id '{rid}' not found.",
                           "previous_response_id")  # fmt: skip
        if entry.model != self.identity(model):
            raise APIError(400, f"Previous response '{rid}' was made by model "
                           f"'{entry.model}', not '{model}'.", "previous_response_id")  # fmt: skip
        if entry.status in ("in_progress", "queued"):
            raise APIError(400, f"Previous response '{rid}' is still in progress.",
                           "previous_response_id")  # fmt: skip
        return entry

    def identity(self, model: str) -> str:
        """What a model name means: aliases of the base model (``--served-model-name``
        given twice) are one model, each LoRA adapter another."""
        lora = self.models.lora_request(model)
        return model if lora is not None else self.config.served_model_names[0]

    def tool_plan(self, req: ResponsesRequest) -> ToolPlan:
        try:
            return plan_tools(chat_tools(req.tools), chat_tool_choice(req.tool_choice),
                              req.parallel_tool_calls, self.config.enable_auto_tool_choice)  # fmt: skip
        except ToolChoiceError as error:
            raise APIError(400, error.message, error.param) from None

    def tag_for(self, request: Request) -> str:
        """The EPP's route tag when it sent a well-formed one, else this engine's."""
        tag = request.headers.get(ROUTE_TAG_HEADER)
        return tag if tag is not None and valid_tag(tag) else self.route_tag

    def base_object(self, rid: str, req: ResponsesRequest, model: str,
                    temperature: float, top_p: float) -> dict[str, Any]:  # fmt: skip
        """The Response object's request-derived fields, as OpenAI echoes them."""
        fmt = req.text.format if req.text is not None and req.text.format else {"type": "text"}
        return {
            "id": rid, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": model, "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None,
            "store": bool(req.store) and self.store is not None, "temperature": temperature,
            "text": {"format": fmt}, "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [], "top_p": top_p, "truncation": "disabled", "usage": None,
            "user": req.user, "metadata": req.metadata or {}, "background": False,
        }  # fmt: skip

    def remember(self, rid: str, req: ResponsesRequest, model: str, run: ResponseRun,
                 history: list[dict[str, Any]]) -> StoredResponse | None:  # fmt: skip
        """Store the running response (GET and cancel see it), when ``store`` asks."""
        if self.store is None or not req.store:
            return None
        entry = StoredResponse(self.identity(model), run.snapshot(), history)
        self.store.put(rid, entry)
        return entry

    # -- retrieve and cancel -------------------------------------------------------------
    def stored(self, response_id: str) -> StoredResponse:
        if not response_id.startswith("resp_"):
            raise APIError(400, f"Invalid 'response_id': '{response_id}'. Expected an ID "
                           "that begins with 'resp'.", "response_id")  # fmt: skip
        entry = self.store.get(response_id) if self.store is not None else None
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return entry

    def retrieve(self, response_id: str, stream: str | None) -> dict[str, Any]:
        if stream not in (None, "false"):
            raise APIError(400, "stream=true (replaying a response's events) is not "
                           "supported.", "stream")  # fmt: skip
        return copy.deepcopy(self.stored(response_id).response)

    def cancel(self, response_id: str) -> dict[str, Any]:
        """Stop a running response (its engine request is aborted), as vLLM's cancel;
        one that already finished is a 400 with vLLM's message."""
        entry = self.stored(response_id)
        if entry.status not in ("queued", "in_progress"):
            raise APIError(400, "Cannot cancel a synchronous response.", "response_id")
        entry.response["status"] = "cancelled"
        entry.cancel.set()
        return copy.deepcopy(entry.response)


def add_responses_routes(app: FastAPI, serving: OpenAIServingResponses) -> None:
    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await serving.create(request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: str | None = None) -> dict[str, Any]:
        return serving.retrieve(response_id, stream)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return serving.cancel(response_id)


def _sampling(req: ResponsesRequest) -> _Sampling:
    """The chat path's sampling fields of a Responses request (the others at defaults)."""
    fields: dict[str, Any] = {"model": req.model, "temperature": req.temperature,
                              "top_p": req.top_p, "user": req.user}  # fmt: skip
    if "priority" in req.model_fields_set:  # only a priority given wins over the header's
        fields["priority"] = req.priority
    return _Sampling.model_construct(**fields)


def items_dump(items: list[Any]) -> list[dict[str, Any]]:
    return [item.model_dump(mode="json") for item in items]


@contextmanager
def _responses_params() -> Iterator[None]:
    """The shared chat checks' errors, naming the Responses field they concern."""
    try:
        yield
    except APIError as error:
        error.param = _PARAM_NAMES.get(error.param or "", error.param)
        raise


async def _whole(request: Request, run: ResponseRun,
                 events: AsyncGenerator[dict[str, Any], None]) -> Response:  # fmt: skip
    """A non-streamed answer: run every event, answer the final Response object."""
    if await run_to_end(request, events) is None:
        return Response(status_code=499)  # nginx's "client closed request"
    if run.error is not None:
        raise APIError(500, run.error)
    return JSONResponse(run.response)


async def _sse(events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[str]:
    """Responses SSE: each event named by its type, as OpenAI sends them. Closing this
    (the client left) closes the events now, which aborts the engine request."""
    try:
        async for event in events:
            yield f"event: {event['type']}\n{sse(event)}"
    finally:
        await events.aclose()
