"""A model's chat template is the model file's code: whatever it raises on a conversation is
the template failing on it, told at start-up for one user message (one line naming the file)
and as a 400 naming ``messages`` for a request, never a 500 and a traceback in the log."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from replystream.engine.gguf_engine import load_gguf_engine
from replystream.server import create_app, running
from tests.gguf_files import CHATML, write_llama_gguf

# Python operations a template may do that fail on some values: a division by zero, a string
# method given what it cannot find, a float past its range, the sandbox's own range limit, a
# macro that calls itself.
FAILING = {
    "division": "{{ 1 // 0 }}",
    "substring": "{{ 'abc'.index('z') }}",
    "overflow": "{{ 10.0 ** 1000 }}",
    "range": "{% for i in range(10 ** 7) %}{% endfor %}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}


@pytest.mark.parametrize("failing", FAILING.values(), ids=FAILING.keys())
def test_a_template_failing_on_one_user_message_is_refused_at_load(
    tmp_path: Path, failing: str
) -> None:
    path = write_llama_gguf(tmp_path / "model.gguf", meta={"tokenizer.chat_template": failing})
    with pytest.raises(ValueError, match="the chat template fails on one user message: ") as no:
        load_gguf_engine(path)
    assert str(no.value).startswith(f"{path}: ") and "\n" not in str(no.value)


@pytest.mark.parametrize("failing", FAILING.values(), ids=FAILING.keys())
async def test_a_template_failing_on_a_conversation_is_the_requests_400(
    tmp_path: Path, failing: str
) -> None:
    template = CHATML + "{% if messages | length > 1 %}" + failing + "{% endif %}"
    path = write_llama_gguf(tmp_path / "model.gguf", meta={"tokenizer.chat_template": template})
    engine, _ = load_gguf_engine(path)
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = {"model": "gguf", "messages": two, "max_tokens": 2}
    async with running(create_app(engine)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert error["param"] == "messages"
    assert error["message"].startswith("the model's chat template refuses these messages: ")
