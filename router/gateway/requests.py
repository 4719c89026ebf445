"""The gateway's request bodies as models: validation with bounds, and the OpenAPI schema.

Each endpoint validates its JSON body with one of these models before routing or any admin
call (:func:`validate`), so a request that breaks a bound changes nothing. Fields the gateway
does not know pass through to the worker (OpenAI has many); known ones are checked for kind
and range: finite numbers only, strict booleans and integers, bounded lengths. The bounds that
an operator sets (``max_tokens``, ``ttl_s``, ``deadline_s``) come from :class:`Limits` at
validation time. :func:`document` puts the schemas into the app's OpenAPI spec, so clients and
schema-driven testers (schemathesis) see what each endpoint takes.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from kvshare.router.gateway.limits import BadRequest, Limits

MAX_ITEMS = 4096  # messages per chat, prompts per batch, content parts
MAX_TOKEN_ID = 2**31 - 1

TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Text = Annotated[StrictStr, Field(max_length=8 * 2**20)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class Sampling(_Body):
    """What completions and chat share."""

    model: Name | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Finite, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Finite, Field(ge=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=1_000_000)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=16)] | None = None
    presence_penalty: Annotated[Finite, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Finite, Field(ge=-2, le=2)] | None = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stream: StrictBool = False
    stop: Annotated[StrictStr, Field(max_length=1024)] | Annotated[
        list[Annotated[StrictStr, Field(max_length=1024)]], Field(max_length=16)] | None = None
    user: Annotated[StrictStr, Field(max_length=256)] | None = None
    deadline_s: Annotated[Finite, Field(gt=0)] | None = None


Prompt = (Text | Annotated[list[TokenId], Field(min_length=1, max_length=2**20)]
          | Annotated[list[Text], Field(min_length=1, max_length=1)]
          | Annotated[list[Annotated[list[TokenId], Field(min_length=1, max_length=2**20)]],
                      Field(min_length=1, max_length=1)])


class CompletionRequest(Sampling):
    """``POST /v1/completions``: one prompt (text, token ids, or a list of one of them)."""

    prompt: Prompt


class ContentPart(_Body):
    type: Annotated[StrictStr, Field(max_length=64)]
    text: Text | None = None


class ChatMessage(_Body):
    role: Annotated[StrictStr, Field(min_length=1, max_length=64)]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_ITEMS)] | None = None
    name: Annotated[StrictStr, Field(max_length=256)] | None = None


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_ITEMS)]


class RouteRequest(_Body):
    """``POST /v1/route``: ``prompt`` or ``messages`` (the decision only)."""

    prompt: Prompt | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_ITEMS)] | None = None


class AdminRequest(RouteRequest):
    """``POST /v1/kvshare/{op}``: the prefix as ``prompt`` or ``messages`` plus the op's fields
    (``name`` for pin/unpin, ``ttl_s`` for pin, ``node``/``deadline_s`` for prefetch)."""

    name: Name | None = None
    ttl_s: Annotated[Finite, Field(gt=0)] | None = None
    nodes: Annotated[list[Name], Field(max_length=MAX_ITEMS)] | None = None
    node: Name | None = None
    deadline_s: Annotated[Finite, Field(gt=0)] | None = None


def _where(err: Any) -> str:
    """The field path of a pydantic error, without the names of union branches."""
    loc = [str(p) for p in err.get("loc", ()) if isinstance(p, int) or not any(
        c in str(p) for c in "-[")]
    return ".".join(loc) or "body"


def validate(model: type[_Body], body: Any, limits: Limits) -> _Body:
    """``body`` as ``model`` within ``limits``; :class:`BadRequest` names the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        errs = exc.errors(include_url=False, include_input=False)
        first = errs[0]
        where = _where(first)
        if sum(_where(e) == where for e in errs) > 1:  # a union field: no accepted form fits
            raise BadRequest(f"'{where}' has none of its accepted forms (see the OpenAPI spec "
                             f"at /openapi.json); first problem: {first['msg']}", param=where) from None
        more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
        raise BadRequest(f"'{where}': {first['msg']}{more}", param=where) from None
    _bounded(parsed, "max_tokens", limits.max_tokens)
    _bounded(parsed, "max_completion_tokens", limits.max_tokens)
    _bounded(parsed, "ttl_s", limits.max_ttl_s)
    _bounded(parsed, "deadline_s", limits.max_deadline_s)
    return parsed


def _bounded(parsed: _Body, field: str, limit: float) -> None:
    value = getattr(parsed, field, None)
    if value is not None and value > limit:
        raise BadRequest(f"'{field}' is {value}, over this gateway's limit of {limit:g}",
                         param=field)


def document(app: Any, bodies: dict[tuple[str, str], type[_Body]]) -> None:
    """Describe each ``(method, path)``'s JSON request body in ``app``'s OpenAPI spec."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return dict(app.openapi_schema)
        spec: dict[str, Any] = base()
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for (method, path), model in bodies.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            op = spec["paths"].get(path, {}).get(method)
            if op is None:
                continue
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = spec
        return spec

    app.openapi = openapi
