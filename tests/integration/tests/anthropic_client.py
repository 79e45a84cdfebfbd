"""The official Anthropic Python client against a Bellows router, unchanged: messages whole and
through the SDK's stream helper (which accumulates the named events into the same message), a
system prompt as blocks, tool use with a tool_result round trip, structured output parsed into a
Pydantic model, count_tokens, and errors surfacing as the client's own exceptions.
Run by tests/real_model.rs with BASE_URL and MODEL set; exits non-zero on any mismatch."""
import os
import sys

import anthropic
import pydantic

client = anthropic.Anthropic(base_url=os.environ["BASE_URL"], api_key="unused", max_retries=0)
model = os.environ["MODEL"]
question = [{"role": "user", "content": "What is the capital of France?"}]
# This SDK no longer takes sampling parameters as arguments; the API still does, so the
# comparisons below ask for greedy decoding the way any extra field is sent.
GREEDY = {"extra_body": {"temperature": 0}}

whole = client.messages.create(model=model, max_tokens=12, **GREEDY, messages=question)
assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_"), whole
assert [b.type for b in whole.content] == ["text"] and whole.content[0].text, whole
assert whole.stop_reason in ("end_turn", "max_tokens"), whole
assert whole.usage.output_tokens > 0 and whole.usage.input_tokens > 0, whole.usage

# The stream helper rebuilds the message from the events alone: the same one, token for token.
with client.messages.stream(model=model, max_tokens=12, **GREEDY, messages=question) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
assert text == whole.content[0].text, (text, whole.content[0].text)
assert final.content[0].text == text and final.stop_reason == whole.stop_reason, final
assert final.usage.output_tokens == whole.usage.output_tokens, (final.usage, whole.usage)

# A system prompt as a list of text blocks is the same prompt as the string.
as_string = client.messages.create(model=model, max_tokens=8, **GREEDY, system="Answer in French.", messages=question)
as_blocks = client.messages.create(
    model=model, max_tokens=8, **GREEDY, system=[{"type": "text", "text": "Answer in French."}], messages=question
)
assert as_string.content[0].text == as_blocks.content[0].text, (as_string, as_blocks)
def prompt_size(m):
    return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


# (The template writes a default system prompt when there is none: a different prompt, not a longer one.)
assert prompt_size(as_string) == prompt_size(as_blocks) != prompt_size(whole), (as_string.usage, whole.usage)

weather = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ask_weather = [{"role": "user", "content": "What is the weather in Paris right now?"}]
for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
    first = client.messages.create(
        model=model, max_tokens=80, **GREEDY, messages=ask_weather, tools=[weather], tool_choice=choice
    )
    assert first.stop_reason == "tool_use", first
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_"), first
    assert isinstance(calls[0].input.get("city"), str) and calls[0].input.get("unit") in ("celsius", "fahrenheit"), calls

    with client.messages.stream(
        model=model, max_tokens=80, **GREEDY, messages=ask_weather, tools=[weather], tool_choice=choice
    ) as stream:
        streamed = stream.get_final_message()
    streamed_calls = [b for b in streamed.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in streamed_calls] == [(calls[0].name, calls[0].input)], streamed
    assert streamed.stop_reason == "tool_use", streamed

    answer = client.messages.create(
        model=model,
        max_tokens=40,
        **GREEDY,
        tools=[weather],
        messages=ask_weather
        + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "21 C, clear"}]},
        ],
    )
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text, answer


# Structured output the way the SDK writes it: a Pydantic model as output_format.
class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


parsed = client.messages.parse(
    model=model,
    max_tokens=200,
    **GREEDY,
    messages=[{"role": "user", "content": "Describe Paris as JSON with its name, country and population."}],
    output_format=City,
)
assert parsed.stop_reason == "end_turn", parsed
assert isinstance(parsed.parsed_output, City), parsed

counted = client.messages.count_tokens(model=model, messages=question)
assert counted.input_tokens == prompt_size(whole), (counted, whole.usage)
with_tools = client.messages.count_tokens(model=model, messages=ask_weather, tools=[weather])
assert with_tools.input_tokens > client.messages.count_tokens(model=model, messages=ask_weather).input_tokens

try:
    client.messages.create(model=model, max_tokens=8, messages=question, extra_body={"temperature": 1.5})
    sys.exit("an out-of-range temperature must raise")
except anthropic.BadRequestError as e:
    assert e.body["error"]["type"] == "invalid_request_error" and "temperature" in e.body["error"]["message"], e.body
try:
    client.messages.create(model="no-such-model", max_tokens=8, messages=question)
    sys.exit("an unknown model must raise")
except anthropic.NotFoundError as e:
    assert e.body["error"]["type"] == "not_found_error", e.body
try:
    client.messages.create(
        model=model,
        max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}]}],
    )
    sys.exit("a tool_result without its tool_use must raise")
except anthropic.BadRequestError as e:
    assert "tool_use_id" in e.body["error"]["message"], e.body
print("anthropic client: ok")
