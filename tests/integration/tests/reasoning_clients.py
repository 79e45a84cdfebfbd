"""The official OpenAI and Anthropic Python clients read a thinking model's reasoning apart from
its answer, unchanged: chat's `reasoning_content`, a Responses `reasoning` item (whole, and rebuilt
by the stream helper), a continuation whose history held one, and Anthropic `thinking` blocks
(whole, and accumulated by the stream helper). The model always thinks first and 12 tokens end it
mid-thought, so all of its text is thinking.
Run by tests/reasoning.rs with BASE_URL and MODEL set; exits non-zero on any mismatch."""
import os

import anthropic
import openai

model = os.environ["MODEL"]
question = "Is 7 prime?"
oa = openai.OpenAI(base_url=os.environ["BASE_URL"] + "/v1", api_key="unused", max_retries=0)

chat = oa.chat.completions.create(
    model=model, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0
)
thinking = chat.choices[0].message.model_extra["reasoning_content"]
assert thinking and chat.choices[0].message.content == "", chat
assert chat.usage.completion_tokens_details.reasoning_tokens == 12, chat.usage

first = oa.responses.create(model=model, input=question, max_output_tokens=12, temperature=0)
assert [item.type for item in first.output] == ["reasoning"], first
assert first.output[0].content[0].text == thinking, (first.output[0], thinking)
assert first.output_text == "", "thinking is not output text"
assert first.usage.output_tokens_details.reasoning_tokens == 12, first.usage

# Cut off, the stream ends in `response.incomplete` (the helper's final response is only a
# completed one's), which carries the whole output.
with oa.responses.stream(model=model, input=question, max_output_tokens=12, temperature=0) as stream:
    events = list(stream)
deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
assert deltas == thinking, (deltas, thinking)
assert events[-1].type == "response.incomplete", events[-1]
final = events[-1].response
assert final.output[0].type == "reasoning" and final.output[0].content[0].text == thinking, final

# The stored reasoning item is history the template leaves out: the continuation runs.
second = oa.responses.create(
    model=model, input="And 9?", previous_response_id=first.id, max_output_tokens=4, temperature=0
)
assert second.output[0].type == "reasoning" and second.previous_response_id == first.id, second

an = anthropic.Anthropic(base_url=os.environ["BASE_URL"], api_key="unused", max_retries=0)
GREEDY = {"extra_body": {"temperature": 0}}
ask = [{"role": "user", "content": question}]
whole = an.messages.create(model=model, max_tokens=12, **GREEDY, messages=ask)
assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].thinking == thinking, whole
assert whole.stop_reason == "max_tokens", whole

with an.messages.stream(model=model, max_tokens=12, **GREEDY, messages=ask) as stream:
    streamed = "".join(e.thinking for e in stream if e.type == "thinking")
    message = stream.get_final_message()
assert streamed == thinking, (streamed, thinking)
assert message.content[0].type == "thinking" and message.content[0].thinking == thinking, message

# Thinking sent back in the history, as Anthropic's clients send it, is taken.
turn = an.messages.create(
    model=model,
    max_tokens=4,
    **GREEDY,
    messages=ask
    + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": thinking, "signature": ""}, {"type": "text", "text": "Yes."}]},
        {"role": "user", "content": "Sure?"},
    ],
)
assert turn.content[0].type == "thinking", turn
try:
    an.messages.create(model=model, max_tokens=12, thinking={"type": "enabled", "budget_tokens": 10}, messages=ask)
    raise AssertionError("a budget under 1024 was taken")
except anthropic.BadRequestError as e:
    assert "budget_tokens" in str(e), e
print("ok")
