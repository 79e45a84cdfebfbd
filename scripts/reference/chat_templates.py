#!/usr/bin/env python3
"""Render published models' chat templates the way Hugging Face's `apply_chat_template` does, as
the reference for Bellows' renderer (crates/worker/tests/chat_templates_match_hf.rs).

A prompt one newline away from the training format changes what the model conditions on, and
nothing fails. The templates come from llama.cpp's sources (`scripts/fetch-model.sh
llama-cpp-vocabs`, templates/*.jinja); the environment is transformers' own: a sandboxed Jinja2
environment with trim_blocks and lstrip_blocks, loop controls, `raise_exception`, `strftime_now`
and a `tojson` that is Python's json.dumps without ASCII escaping. `strftime_now` is pinned to
DATE so the fixture does not change with the day.

    .venv/bin/python scripts/reference/chat_templates.py \
        [--templates ~/.cache/bellows/models/llama-cpp-0.3.36-vocabs/templates] \
        [--out crates/worker/tests/fixtures/chat_template_reference.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TEMPLATES = Path.home() / ".cache/bellows/models/llama-cpp-0.3.36-vocabs/templates"
DEFAULT_OUT = REPO / "crates/worker/tests/fixtures/chat_template_reference.json"
DATE = datetime.datetime(2026, 12, 3, 9, 5, 0)
BOS, EOS = "<BOS>", "<EOS>"

# The templates of the families Bellows loads or whose tool-call formats the router parses.
TEMPLATES = [
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "Qwen-Qwen2.5-7B-Instruct.jinja",
    "Qwen-Qwen3-0.6B.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "google-gemma-2-2b-it.jinja",
    "HuggingFaceTB-SmolLM3-3B.jinja",
    "microsoft-Phi-3.5-mini-instruct.jinja",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "Its name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}

# (name, messages, tools, add_generation_prompt, chat_template_kwargs). Messages use only what
# Bellows' ChatMessage carries: role, content, tool_calls (arguments as an object), tool_call_id.
CONVERSATIONS = [
    ("one_user_turn", [{"role": "user", "content": "Hi there"}], None, True, None),
    (
        "system_and_history",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "  And 3+3?  "},
        ],
        None,
        True,
        None,
    ),
    (
        "no_generation_prompt",
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        None,
        False,
        None,
    ),
    (
        "tools_and_a_call",
        [
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "abc123def",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                    }
                ],
            },
            {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "abc123def"},
        ],
        [WEATHER],
        True,
        None,
    ),
    (
        "two_users_in_a_row",
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        None,
        True,
        None,
    ),
    (
        "thinking_off",
        [{"role": "user", "content": "What is 2+2?"}],
        None,
        True,
        {"enable_thinking": False},
    ),
]


def environment() -> jinja2.Environment:
    """transformers.utils.chat_template_utils._compile_jinja_template's environment."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: DATE.strftime(fmt)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--templates", type=Path, default=DEFAULT_TEMPLATES)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args()
    env = environment()
    renders = []
    for name in TEMPLATES:
        template = env.from_string((a.templates / name).read_text(encoding="utf-8"))
        for conv, messages, tools, gen, kwargs in CONVERSATIONS:
            ctx = {"messages": messages, "add_generation_prompt": gen, "bos_token": BOS, "eos_token": EOS}
            ctx.update(kwargs or {})
            if tools is not None:
                ctx["tools"] = tools
            try:
                renders.append({"template": name, "conversation": conv, "prompt": template.render(**ctx)})
            except jinja2.exceptions.TemplateError as e:
                renders.append({"template": name, "conversation": conv, "error": str(e)})
    conversations = [
        {"name": c, "messages": m, "tools": t, "add_generation_prompt": g, "chat_template_kwargs": k}
        for c, m, t, g, k in CONVERSATIONS
    ]
    result = {
        "generator": "scripts/reference/chat_templates.py",
        "jinja2": jinja2.__version__,
        "date": DATE.isoformat(),
        "bos_token": BOS,
        "eos_token": EOS,
        "conversations": conversations,
        "renders": renders,
    }
    a.out.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(renders)} renders to {a.out}")


if __name__ == "__main__":
    main()
