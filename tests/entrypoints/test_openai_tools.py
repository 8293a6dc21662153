"""Tool calling through the real server and the official `openai` client, on a tiny random Llama with
a Hermes-style chat template (--chat-template): named and required choices always return valid calls
(structured output), auto calls are parsed out of the text, streamed as tool-call deltas, and tool
messages are rendered."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from nanoserve.engine.processor import Processor
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest
from tests.entrypoints.test_openai_server import Server

TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Call one as <tool_call>
{"name": <name>, "arguments": <object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_gqa_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "template.jinja").write_text(TEMPLATE)
    srv = Server(tiny_gqa_dir, folder / "server.log", "--chat-template", str(folder / "template.jinja"))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def streamed_calls(chunks) -> tuple[str, list[dict], str | None]:
    """Reassemble OpenAI tool-call deltas: (content, [{id, name, arguments}], finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def calls_of(client, stream: bool, **kwargs) -> tuple[str | None, list[dict], str | None]:
    kwargs = {"model": None, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, **kwargs}
    if stream:
        return streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls or []
    ]
    return choice.message.content, calls, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_always_returns_that_function_with_valid_arguments(client, stream):
    for seed in range(4):
        name = ["get_weather", "get_time"][seed % 2]
        choice = {"type": "function", "function": {"name": name}}
        content, calls, finish = calls_of(client, stream, tool_choice=choice, temperature=1.0, seed=seed)
        assert not content and finish == "stop"
        (call,) = calls
        assert call["name"] == name and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_returns_valid_calls(client, stream):
    for seed in range(3):
        _, calls, finish = calls_of(
            client,
            stream,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            parallel_tool_calls=False,
            max_tokens=120,
        )
        assert finish == "tool_calls"
        (call,) = calls
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


FORCED = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed_out_of_the_text(client, stream):
    """The output is forced (a regex) to what a Hermes model writes; the server must read the call out."""
    regex = FORCED.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")
    content, calls, finish = calls_of(
        client, stream, temperature=0, extra_body={"structured_outputs": {"regex": regex}}
    )
    assert content.strip() == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"zone": "UTC"})]
    assert finish == "tool_calls"


def test_tool_choice_none_and_plain_text(client):
    content, calls, _ = calls_of(client, False, tool_choice="none", temperature=0, max_tokens=5)
    assert calls == [] and content


def test_tool_messages_are_rendered(client, tokenizer_dir):
    from transformers import AutoTokenizer

    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = ChatCompletionRequest(messages=messages, tools=TOOLS)
    processor = Processor(AutoTokenizer.from_pretrained(tokenizer_dir), 512, 2)
    tools = [t.model_dump(exclude_none=True) for t in request.tools]
    prompt = processor.render_chat(request.conversation(), tools=tools, chat_template=TEMPLATE)["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in prompt
    assert '<tool_response id="call_1">\nsunny\n</tool_response>' in prompt
    assert '"name": "get_time"' in prompt
    reply = client.chat.completions.create(
        model=None, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=3
    )
    assert reply.usage.prompt_tokens == len(
        processor.render_chat(request.conversation(), tools=tools, chat_template=TEMPLATE)["prompt_token_ids"]
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools"),
    ],
)
def test_bad_tool_requests_are_400s(server, body, param):
    payload = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=60)
    assert response.status_code == 400, response.text
    assert param in (response.json()["error"].get("param") or "") + response.json()["error"]["message"]


def test_tools_without_a_template_that_renders_them_are_refused(own_server_factory):
    srv = own_server_factory()
    response = httpx.post(
        f"{srv.url}/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS}, timeout=60
    )
    assert response.status_code == 400 and "--chat-template" in response.json()["error"]["message"]


@pytest.fixture
def own_server_factory(tiny_gqa_dir, tmp_path):
    servers: list[Server] = []

    def start(*extra: str) -> Server:
        servers.append(Server(tiny_gqa_dir, tmp_path / f"server{len(servers)}.log", *extra))
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()
