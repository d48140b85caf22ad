"""`serve --engine smollm2` over a real socket: a chat question, answered in English; with
`--seed`, a request that gives no seed is sampled with the server's."""

from __future__ import annotations

import json

import aiohttp

from tests.processes import replica
from tests.services import require_smollm2


async def test_serve_smollm2_answers_in_english_reports_a_cut_reply_and_samples_by_its_seed():
    require_smollm2()
    async with replica("--engine", "smollm2", "--seed", "7", ready_s=180) as (_, url):
        async with aiohttp.ClientSession() as http:
            body = {
                "model": "smollm2",  # the served model is the engine's name
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "temperature": 0,
                "max_tokens": 60,
            }
            async with http.post(f"{url}/v1/chat/completions", json=body) as response:
                assert response.status == 200
                answer = (await response.json())["choices"][0]
            cut = {**body, "max_tokens": 3, "stream": True}
            async with http.post(f"{url}/v1/chat/completions", json=cut) as response:
                assert response.status == 200
                events = [
                    json.loads(line[6:])
                    for line in (await response.text()).splitlines()
                    if line.startswith("data: {")
                ]
            sampled = []
            for seed in ({}, {}, {"seed": 7}, {"seed": 8}):
                ask = {**body, "temperature": 1, "max_tokens": 8, **seed}
                async with http.post(f"{url}/v1/chat/completions", json=ask) as response:
                    assert response.status == 200
                    sampled.append((await response.json())["choices"][0]["message"]["content"])
            async with http.get(f"{url}/healthz") as response:
                health = await response.json()
    text = answer["message"]["content"]
    assert answer["finish_reason"] in ("stop", "length")
    assert "Paris" in text and len(text.split()) >= 3
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["length"]  # cut by max_tokens: reported as cut, never as complete
    # No seed: the server's (--seed 7), every time; a request's own seed still wins.
    assert sampled[0] == sampled[1] == sampled[2] != sampled[3]
    assert health["engine"] == "smollm2"
