"""The tiny engine with a chat template that has a system prompt of its own, for tests that
compare a prompt's count with what a reply reports (the count must hold the template's tokens,
not only the conversation's text)."""

from __future__ import annotations

from replystream.engine.chat_template import ChatTemplate
from replystream.engine.prompts import ChatPrompt
from replystream.engine.tiny import TinyEngine, load_default_engine

# A chat template with a system prompt of its own, as SmolLM2's has: the prompt the model
# reads is many more tokens than the conversation's text.
TEMPLATE = (
    "{{ 'system: You answer in one sentence.\\n' }}"
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
TEMPLATE_RENDERING = "system: You answer in one sentence.\nuser: {text}\nassistant:"


def tiny_with_template() -> TinyEngine:
    default = load_default_engine()
    prompts = ChatPrompt(
        default.tokenizer, ChatTemplate(TEMPLATE), default.tokenizer.encode("\n")[0]
    )
    return TinyEngine(default.model, default.tokenizer, prompts=prompts)
