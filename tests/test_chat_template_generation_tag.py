"""``{% generation %}``: the tag ``transformers`` gives chat templates to mark an assistant's
text (for training masks). A template using it renders as ``transformers`` renders it, its body
as if unmarked, rather than being refused at load as not Jinja."""

from __future__ import annotations

from pathlib import Path

from replystream.engine.chat_template import ChatTemplate
from replystream.engine.gguf_engine import load_gguf_engine
from tests.gguf_files import write_llama_gguf

MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_marking_the_assistants_text_renders_its_body() -> None:
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert ChatTemplate(MARKED).render(turns) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_gguf_whose_template_marks_the_assistants_text_loads(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "model.gguf", meta={"tokenizer.chat_template": MARKED})
    load_gguf_engine(path)
