"""The official OpenAI Python client's Responses API against a Bellows router, unchanged:
create, the stream helper (which rebuilds the response from the events alone), parse into a
Pydantic model, a function-tool round trip, previous_response_id across two turns, retrieve,
input_items and delete, and errors surfacing as the client's own exceptions.
Run by tests/real_model.rs with BASE_URL and MODEL set; exits non-zero on any mismatch."""
import json
import os
import sys

import openai
import pydantic

client = openai.OpenAI(base_url=os.environ["BASE_URL"] + "/v1", api_key="unused", max_retries=0)
model = os.environ["MODEL"]

# Room to finish: the stream helper's final response is `response.completed`'s, and a response cut
# short by max_output_tokens ends with `response.incomplete` instead (as OpenAI's do).
first = client.responses.create(model=model, input="What is 2 + 2?", max_output_tokens=64, temperature=0)
assert first.id.startswith("resp_") and first.object == "response", first
assert first.output_text, first
assert first.status == "completed", first
assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0, first.usage

with client.responses.stream(model=model, input="What is 2 + 2?", max_output_tokens=64, temperature=0) as stream:
    deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    final = stream.get_final_response()
assert deltas == first.output_text, (deltas, first.output_text)
assert final.output_text == first.output_text and final.status == first.status, final
assert final.usage.output_tokens == first.usage.output_tokens, (final.usage, first.usage)

# Two turns: the second sees the first (stored by default) without resending it.
second = client.responses.create(
    model=model, input="And 3 + 3?", previous_response_id=first.id, max_output_tokens=16, temperature=0
)
assert second.previous_response_id == first.id, second
assert second.usage.input_tokens > first.usage.input_tokens, (second.usage, first.usage)
assert second.usage.input_tokens_details.cached_tokens > 0, second.usage
retrieved = client.responses.retrieve(second.id)
assert retrieved.id == second.id and retrieved.output_text == second.output_text, retrieved
items = client.responses.input_items.list(second.id)
assert [i.type for i in items.data] == ["message"], items
assert items.data[0].content[0].text == "And 3 + 3?", items


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int


parsed = client.responses.parse(
    model=model,
    input="Describe Paris as JSON with its name, country and population.",
    text_format=City,
    max_output_tokens=200,
    temperature=0,
)
assert parsed.status == "completed", parsed
assert isinstance(parsed.output_parsed, City), parsed

weather = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ask = client.responses.create(
    model=model,
    input="What is the weather in Paris right now?",
    tools=[weather],
    tool_choice="required",
    parallel_tool_calls=False,
    max_output_tokens=80,
    temperature=0,
)
calls = [o for o in ask.output if o.type == "function_call"]
assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_"), ask
args = json.loads(calls[0].arguments)
assert isinstance(args.get("city"), str) and args.get("unit") in ("celsius", "fahrenheit"), args

with client.responses.stream(
    model=model,
    input="What is the weather in Paris right now?",
    tools=[weather],
    tool_choice="required",
    parallel_tool_calls=False,
    max_output_tokens=80,
    temperature=0,
) as stream:
    streamed = stream.get_final_response()
streamed_calls = [o for o in streamed.output if o.type == "function_call"]
assert [(c.name, c.arguments) for c in streamed_calls] == [(calls[0].name, calls[0].arguments)], streamed

answer = client.responses.create(
    model=model,
    previous_response_id=ask.id,
    input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"temperature": 21})}],
    tools=[weather],
    max_output_tokens=40,
    temperature=0,
)
assert answer.output_text, answer

client.responses.delete(first.id)
try:
    client.responses.retrieve(first.id)
    sys.exit("a deleted response must be gone")
except openai.NotFoundError as e:
    assert e.body["code"] == "response_not_found", e.body
try:
    client.responses.create(model=model, input="x", previous_response_id="resp_nope")
    sys.exit("an unknown previous_response_id must raise")
except openai.NotFoundError as e:
    assert e.body["param"] == "previous_response_id", e.body
try:
    client.responses.create(model=model, input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}])
    sys.exit("an unanswerable function_call_output must raise")
except openai.BadRequestError as e:
    assert e.body["param"] == "input[0].call_id", e.body
print("openai responses: ok")
