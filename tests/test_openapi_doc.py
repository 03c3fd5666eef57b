"""``/openapi.json`` is generated from the gateway's router and its msgspec types: every route it serves is
listed with its methods, every field of every request type is in the schemas (with the type's own bounds),
a field declared only to be refused states the values that are a no-op, and the answers decode as the
response types the document names. The live document, with an engine's limits, is fuzzed against the
server in tests/test_fuzz_openapi.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from helpers.fixtures import gateway_without_engine
from helpers.stack import MODEL

from dpu_gateway import openapi as doc
from dpu_gateway import protocol


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[TestClient]:
    """The real gateway app, its engine not up (the document then states no engine limits)."""
    async with gateway_without_engine(tmp_path, model_aliases=("short",)) as client:
        yield client


async def document(client: TestClient) -> dict:
    resp = await client.get("/openapi.json")
    assert resp.status == 200
    return await resp.json()


def served(app: web.Application) -> dict[str, set[str]]:
    """Path -> methods, from the app's router."""
    out: dict[str, set[str]] = {}
    for route in app.router.routes():
        out.setdefault(route.resource.canonical, set()).add(route.method.lower())
    return out


def documented_types(app: web.Application) -> set[type]:
    ops = [doc.operation_of(route.handler) for route in app.router.routes()]
    return {op.body for op in ops if op.body is not None}


def nested_structs(t: type, seen: set[type] | None = None) -> set[type]:
    """``t`` and every struct type its fields hold (at any depth)."""
    seen = set() if seen is None else seen
    if t in seen:
        return seen
    seen.add(t)
    for field in msgspec.structs.fields(t):
        for inner in struct_types_in(msgspec.inspect.type_info(field.type)):
            nested_structs(inner, seen)
    return seen


def struct_types_in(info: msgspec.inspect.Type) -> list[type]:
    if isinstance(info, msgspec.inspect.StructType):
        return [info.cls]
    out: list[type] = []
    for name in ("types", "item_type", "value_type"):
        inner = getattr(info, name, None)
        for one in inner if isinstance(inner, tuple) else [inner] if inner is not None else []:
            out += struct_types_in(one)
    return out


async def test_every_route_is_listed_with_its_methods(gateway: TestClient) -> None:
    paths = (await document(gateway))["paths"]
    routes = served(gateway.server.app)
    assert {p: set(ops) for p, ops in paths.items()} == routes
    for path in ("/tokenize", "/detokenize", "/version", "/v1/models/{model}"):  # once missing
        assert path in paths
    assert paths["/v1/models/{model}"]["get"]["parameters"][0]["schema"]["enum"] == [MODEL, "short"]


async def test_every_request_field_is_in_the_schemas(gateway: TestClient) -> None:
    schemas = (await document(gateway))["components"]["schemas"]
    bodies = documented_types(gateway.server.app)
    assert bodies == {protocol.ChatCompletionRequest, protocol.CompletionRequest, protocol.TokenizeRequest,
                      protocol.DetokenizeRequest, protocol.ResponsesRequest}
    kept = set()
    for body in bodies:
        kept |= nested_structs(body)
    kept -= set(protocol._PART_REFUSED)  # refused content parts are left out
    for t in kept:
        tag = t.__struct_config__.tag_field  # a content part's "type"
        fields = {f.encode_name for f in msgspec.structs.fields(t)} | ({tag} if tag else set())
        assert set(schemas[t.__name__].get("properties", {})) == fields, t.__name__
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["n"] == {"type": "integer", "minimum": 1, "maximum": protocol.MAX_N, "default": 1}
    # no engine: no engine bound is stated; the model's names are
    assert "maximum" not in json.dumps(chat["max_tokens"])
    assert chat["model"]["enum"] == [MODEL, "short"]
    assert schemas["DetokenizeRequest"]["properties"]["model"]["anyOf"][0]["enum"] == [MODEL, "short", ""]


async def test_refused_fields_state_their_no_op_values(gateway: TestClient) -> None:
    """Every value the document lets a refused field take, the decoder takes; every refused field is stated."""
    schemas = (await document(gateway))["components"]["schemas"]
    minimal = {protocol.ChatCompletionRequest: ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                                protocol.decode_chat),
               protocol.CompletionRequest: ({"model": MODEL, "prompt": "hi"}, protocol.decode_completion),
               protocol.ResponsesRequest: ({"model": MODEL, "input": "hi"}, protocol.decode_responses)}
    for body, (base, decode) in minimal.items():
        props = schemas[body.__name__]["properties"]
        names = {f.name for f in msgspec.structs.fields(body)} & set(protocol.refused_fields(body))
        assert names
        for name in names:
            values = props[name]["enum"]
            assert None in values, name
            for value in values:
                decode(msgspec.json.encode({**base, name: value}))


async def test_answers_are_of_the_documented_types(gateway: TestClient) -> None:
    paths = (await document(gateway))["paths"]
    for path, answer in (("/v1/models", doc.ModelList), (f"/v1/models/{MODEL}", doc.ModelCard),
                         ("/version", doc.VersionResponse)):
        resp = await gateway.get(path)
        assert resp.status == 200
        msgspec.convert(await resp.json(), answer)
        op = paths[path.replace(MODEL, "{model}")]["get"]
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(answer.__name__)
    resp = await gateway.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})  # no engine: 503
    assert resp.status == 503
    msgspec.convert(await resp.json(), doc.ErrorResponse)
    assert "503" in paths["/v1/completions"]["post"]["responses"]


class Echo(msgspec.Struct, forbid_unknown_fields=True):
    text: str
    times: int = 1


def test_a_new_route_and_type_are_in_the_document() -> None:
    """The document follows the router and the types: nothing else lists the paths or the fields."""

    @doc.documented("Echo", body=Echo, answer=doc.VersionResponse)
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"version": "x"})

    async def undocumented(request: web.Request) -> web.Response:
        """Something new."""
        return web.Response(text="x")

    app = web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_put("/things/{name}", undocumented)
    out = doc.openapi_document(app.router.routes(), doc.DocLimits(("m",)))
    assert out["paths"]["/echo"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Echo"}
    assert set(out["components"]["schemas"]["Echo"]["properties"]) == {"text", "times"}
    assert out["paths"]["/things/{name}"]["put"]["summary"] == "Something new."
    assert out["paths"]["/things/{name}"]["put"]["parameters"][0]["name"] == "name"


def test_engine_limits_are_layered_on_the_types() -> None:
    app = web.Application()
    from dpu_gateway.routes import add_routes

    add_routes(app)
    out = doc.openapi_document(app.router.routes(), doc.DocLimits(("m",), max_output=7, max_prompt=50,
                                                                   vocab_size=100))
    schemas = out["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert [a.get("maximum") for a in completion["max_tokens"]["anyOf"]] == [7, None]
    ids, batch = [a for a in completion["prompt"]["anyOf"] if a.get("type") == "array"]
    assert ids == {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
                   "maxItems": 50}
    assert batch["items"]["anyOf"][1]["maxItems"] == 50  # a list of token-id prompts: each bounded
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert [a.get("maximum") for a in chat["max_completion_tokens"]["anyOf"]] == [7, None]
    # the served model's types are not changed by a document
    assert "maximum" not in json.dumps(msgspec.json.schema(protocol.CompletionRequest)["$defs"]["CompletionRequest"]
                                       ["properties"]["max_tokens"])
