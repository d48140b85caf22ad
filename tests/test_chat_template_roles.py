"""OpenAI's ``developer`` role through a model's chat template: the system message by another
name, so a template that does not know the role gets it as ``system`` (the same instructions,
the same prompt, whichever name the client gave them); a template that knows it renders it."""

from __future__ import annotations

from replystream.engine.chat_template import ChatTemplate

# SmolLM2's kind: ChatML, with a default system turn when the conversation opens without one.
DEFAULT_SYSTEM = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# One that knows the role, as the templates of models trained on it do.
KNOWS_DEVELOPER = (
    "{% for message in messages %}"
    "{% if message['role'] == 'developer' %}{{ '[dev] ' + message['content'] + '\\n' }}"
    "{% else %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
)
USER = {"role": "user", "content": "Hi"}


def test_a_developer_message_is_the_system_message_to_a_template_that_does_not_know_it():
    template = ChatTemplate(DEFAULT_SYSTEM)
    as_developer = template.render([{"role": "developer", "content": "Answer in French."}, USER])
    as_system = template.render([{"role": "system", "content": "Answer in French."}, USER])
    assert as_developer == as_system
    assert as_developer.startswith("<|im_start|>system\nAnswer in French.<|im_end|>\n")
    assert "helpful assistant" not in as_developer  # no default system turn added beside it


def test_a_template_that_knows_the_developer_role_gets_it():
    template = ChatTemplate(KNOWS_DEVELOPER)
    rendered = template.render([{"role": "developer", "content": "Be brief."}, USER])
    assert rendered == "[dev] Be brief.\nuser: Hi\n"
