"""A conversation with tool calls through a chat model's template (SmolLM2's kind, ChatML):
the calls an assistant made and their results are in the prompt as text, not dropped; a
conversation of text alone renders exactly as before."""

from __future__ import annotations

from typing import Any

from replystream.engine.chat_template import ChatTemplate

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_tool_calls_and_their_results_are_written_into_the_prompt():
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "noon"}]},
    ]
    assert ChatTemplate(CHATML).render(messages) == (
        "<|im_start|>user\nWeather and time in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '[call call_1] get_weather {"city": "Paris"}\n'
        "[call call_2] get_time {}<|im_end|>\n"
        "<|im_start|>tool\n[call_1] sunny<|im_end|>\n"
        "<|im_start|>tool\n[call_2] noon<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_text_with_a_call_keeps_its_text_first_and_plain_text_is_unchanged():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
    ]
    rendered = ChatTemplate(CHATML).render(messages, add_generation_prompt=False)
    assert rendered.endswith("<|im_start|>assistant\nLet me look.\n[call c] f {}<|im_end|>\n")
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ChatTemplate(CHATML).render(plain, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    )
