"""The official OpenAI Python client against a Bellows router, unchanged: chat and text
completions, streamed and not, usage, structured outputs (`parse` with a Pydantic model,
json_object), tool calls (a two-turn round trip, required and named, streamed deltas), logprobs,
a per-request `cache_salt`, and errors surfacing as the client's own exceptions.
Run by tests/real_model.rs with BASE_URL and MODEL set; exits non-zero on any mismatch."""
import os
import sys

import json

import openai
import pydantic

client = openai.OpenAI(base_url=os.environ["BASE_URL"] + "/v1", api_key="unused", max_retries=0)
model = os.environ["MODEL"]

models = [m.id for m in client.models.list()]
assert model in models, models

chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=12,
    temperature=0,
)
assert chat.choices[0].message.role == "assistant"
assert chat.choices[0].message.content, chat
assert chat.choices[0].finish_reason in ("stop", "length")
assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 0
assert chat.usage.prompt_tokens_details.cached_tokens >= 0

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=12,
    temperature=0,
    stream=True,
    stream_options={"include_usage": True},
)
text, usage, finish = "", None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        text += c.delta.content or ""
        finish = c.finish_reason or finish
assert text == chat.choices[0].message.content, (text, chat.choices[0].message.content)
assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
assert finish == chat.choices[0].finish_reason

completion = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
assert completion.choices[0].text, completion
streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)
    if c.choices
)
assert streamed == completion.choices[0].text, (streamed, completion.choices[0].text)

# vLLM's per-request cache_salt, as the client sends extensions: cached blocks are shared only by
# requests with the same salt.
salted_messages = [{"role": "user", "content": "List the planets of the solar system, in order, with one fact each."}]
salt = os.urandom(16).hex()


def cached_with(salt):
    r = client.chat.completions.create(
        model=model, messages=salted_messages, max_tokens=1, temperature=0, extra_body={"cache_salt": salt}
    )
    return r.usage.prompt_tokens_details.cached_tokens


assert cached_with(salt) == 0
assert cached_with(salt) > 0, "the same salt reuses its blocks"
assert cached_with(salt + "-other") == 0, "another salt never sees them"
try:
    cached_with("")
    raise AssertionError("an empty cache_salt was accepted")
except openai.BadRequestError as e:
    assert e.body["param"] == "cache_salt", e.body

try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    sys.exit("an unknown model must raise")
except openai.NotFoundError as e:
    assert e.body["code"] == "model_not_found", e.body
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=5)
    sys.exit("an out-of-range temperature must raise")
except openai.BadRequestError as e:
    assert e.body["param"] == "temperature", e.body

# Priority classes by the client's own service_tier parameter (docs/priority.md).
flex = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0, service_tier="flex"
)
assert flex.choices[0].message.content is not None
assert flex.service_tier == "flex", flex.service_tier
assert chat.service_tier == "default", chat.service_tier
try:
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4, service_tier="scale"
    )
    sys.exit("an unknown service_tier must raise")
except openai.BadRequestError as e:
    assert e.body["param"] == "service_tier", e.body


# The SDK's simplest structured call, as a new user writes it: no bounds in the model, so the
# integer's default bound is what lets the answer end (docs/structured-outputs.md).
class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


parsed = client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": "Describe Paris as JSON with its name, country and population."}],
    response_format=City,
    max_tokens=200,
    temperature=0,
)
message = parsed.choices[0].message
assert parsed.choices[0].finish_reason == "stop", parsed
assert isinstance(message.parsed, City), message
assert City.model_validate_json(message.content) == message.parsed

anything = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Give me a JSON object with one key, \"cat\", whose value is the name of a cat."}],
    response_format={"type": "json_object"},
    max_tokens=200,
    temperature=0,
    stream=True,
)
chunks = [c.choices[0] for c in anything if c.choices]
text = "".join(c.delta.content or "" for c in chunks)
# A small object: the answer must end by itself, not at max_tokens (a 135M model can repeat
# itself inside a longer one until the limit, and where it does depends on the CPU's kernels).
assert chunks[-1].finish_reason == "stop", (chunks[-1].finish_reason, text)
assert isinstance(json.loads(text), dict), text

try:
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strin"}}},
    )
    sys.exit("an invalid schema must raise")
except openai.BadRequestError as e:
    assert e.body["param"] == "response_format", e.body

weather_tool = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
time_tool = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
    },
}
question = [{"role": "user", "content": "What is the weather in Paris right now?"}]
for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
    first = client.chat.completions.create(
        model=model, messages=question, tools=[weather_tool, time_tool], tool_choice=choice,
        parallel_tool_calls=False, max_tokens=80, temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls", first
    assert call.type == "function" and call.id.startswith("call_"), call
    if isinstance(choice, dict):
        assert call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    assert isinstance(args.get("city"), str), args

    streamed_calls = {}
    for chunk in client.chat.completions.create(
        model=model, messages=question, tools=[weather_tool, time_tool], tool_choice=choice,
        parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True,
    ):
        for c in chunk.choices:
            assert not c.delta.content, c.delta
            for t in c.delta.tool_calls or []:
                entry = streamed_calls.setdefault(t.index, {"name": "", "arguments": ""})
                entry["name"] += t.function.name or ""
                entry["arguments"] += t.function.arguments or ""
    assert streamed_calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}, streamed_calls

    final = client.chat.completions.create(
        model=model,
        messages=question + [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
        ],
        tools=[weather_tool, time_tool],
        max_tokens=40,
        temperature=0,
    )
    assert final.choices[0].message.content, final
try:
    client.chat.completions.create(
        model=model, messages=question, tools=[weather_tool], tool_choice={"type": "function", "function": {"name": "nope"}}
    )
    sys.exit("an unknown tool_choice must raise")
except openai.BadRequestError as e:
    assert e.body["param"] == "tool_choice", e.body

scored = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=12,
    temperature=0,
    logprobs=True,
    top_logprobs=3,
)
entries = scored.choices[0].logprobs.content
assert len(entries) == scored.usage.completion_tokens, (len(entries), scored.usage)
assert "".join(e.token for e in entries) == scored.choices[0].message.content
for e in entries:
    assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token, e
    assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token, e
assert scored.choices[0].message.content == chat.choices[0].message.content
legacy = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2)
assert "".join(legacy.choices[0].logprobs.tokens) == legacy.choices[0].text, legacy
try:
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21
    )
    sys.exit("top_logprobs over 20 must raise")
except openai.BadRequestError as e:
    assert e.body["param"] == "top_logprobs", e.body
print("openai client: ok")
