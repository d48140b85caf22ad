"""The delivery verdict from text-event times alone, including on a noisy machine."""

from __future__ import annotations

from typing import Any

import pytest

from replystream.client import ReplyTiming
from replystream.lab.diagnosis import Thresholds, bursts_of, compare, diagnose
from replystream.lab.doctor import describe

SSE = {"content-type": "text/event-stream", "cache-control": "no-cache"}


def timing(times: list[float], **overrides: Any) -> ReplyTiming:
    fields: dict[str, Any] = {
        "url": "http://test/stream",
        "streamed": True,
        "complete": True,
        "error": None,
        "status": 200,
        "headers_ms": 1.0,
        "first_chunk_ms": times[0] if times else None,
        "first_text_ms": times[0] if times else None,
        "last_text_ms": times[-1] if times else None,
        "closed_ms": (times[-1] if times else 0.0) + 1,
        "body_bytes": 16 * len(times),
        "text": "w " * len(times),
        "tokens": len(times),
        "text_event_ms": tuple(times),
        "text_event_chars": tuple(2 for _ in times),
        "headers": dict(SSE),
    }
    fields.update(overrides)
    return ReplyTiming(**fields)


def steady(n: int, every_ms: float, start_ms: float = 10.0) -> list[float]:
    return [start_ms + i * every_ms for i in range(n)]


def test_events_one_token_time_apart_are_streaming():
    result = diagnose(timing(steady(200, 10.0)))
    assert result.verdict == "streaming"
    assert result.median_gap_ms == 10.0


def test_a_stall_that_merges_tokens_does_not_make_a_stream_bursty():
    times = steady(200, 10.0)
    # A 150 ms stall on a busy machine: 15 tokens arrive in one read, then the stream goes on.
    times[50:65] = [times[65]] * 15
    assert diagnose(timing(times)).verdict == "streaming"


def test_an_event_stream_typed_in_capitals_is_blamed_on_a_buffering_hop():
    # Media types are case-insensitive: the reply streamed, a hop held it.
    times = [1000.0 + 0.01 * i for i in range(100)] + [2000.0 + 0.01 * i for i in range(100)]
    capitals = {"content-type": "Text/Event-Stream; charset=UTF-8", "server": "nginx"}
    result = diagnose(timing(times, headers=capitals))
    assert result.verdict == "bursty"
    assert result.hop is not None and result.hop.startswith("nginx proxy buffering")


def test_everything_within_milliseconds_at_the_end_is_buffered():
    times = [4000.0 + 0.01 * i for i in range(200)]
    result = diagnose(timing(times))
    assert result.verdict == "buffered"
    assert [b.events for b in result.bursts] == [200]


def test_page_sized_bursts_after_silences_are_bursty_and_name_the_buffer():
    times = [1000.0] * 256 + [2000.0] * 256 + [2600.0] * 88
    result = diagnose(timing(times, headers={**SSE, "server": "nginx/1.22.1"}))
    assert result.verdict == "bursty"
    assert [b.events for b in result.bursts] == [256, 256, 88]
    assert result.bursts[0].approx_bytes == 4096
    assert result.hop is not None and "4 KiB" in result.hop and "nginx" in result.hop


def test_a_compressed_stream_whose_events_came_one_by_one_streams():
    # The compressor flushed after every event (nginx's gzip, mod_deflate, HAProxy's): it
    # held nothing, and the reason still names the encoding.
    result = diagnose(timing(steady(100, 10.0), headers={**SSE, "content-encoding": "gzip"}))
    assert result.verdict == "streaming", result.reason
    assert "compressed (gzip) and flushed after every event" in result.reason
    assert result.hop is None and result.fix is None


def test_a_compressed_stream_whose_events_came_together_is_compressed():
    held = [4000.0 + 0.01 * i for i in range(100)]
    result = diagnose(timing(held, headers={**SSE, "content-encoding": "gzip"}))
    assert result.verdict == "compressed"
    assert "and buffered" in result.reason
    assert result.fix is not None and "gzip_types" in result.fix
    too_few = diagnose(timing(steady(3, 10.0), headers={**SSE, "content-encoding": "br"}))
    assert too_few.verdict == "compressed"  # nothing to judge its delivery by


def test_small_bursts_on_a_200_ms_beat_name_a_corking_hop():
    # HAProxy's defaults: each write sent with MSG_MORE, released by Linux's 200 ms cork
    # timer; 21 events (about 480 bytes) a burst, nowhere near a proxy buffer.
    times = [205.0 + 210.0 * (i // 21) for i in range(400)]
    result = diagnose(timing(times))
    assert result.verdict == "bursty"
    assert result.hop is not None and "small bursts every 210 ms" in result.hop
    assert "HAProxy without option http-no-delay" in result.hop
    assert result.fix is not None and result.fix.startswith("option http-no-delay")


def test_bursts_on_another_beat_are_not_blamed_on_corking():
    times = [500.0 + 500.0 * (i // 21) for i in range(400)]
    result = diagnose(timing(times))
    assert result.verdict == "bursty"
    assert result.hop is not None and result.hop.startswith("a buffering hop")


def test_varnish_is_named_from_its_via_header():
    via = {**SSE, "via": "1.1 varnish (Varnish/7.1)"}
    held = diagnose(timing([4000.0] * 100, headers=via))
    assert held.verdict == "buffered"
    assert held.hop is not None and held.hop.startswith("Varnish: beresp.do_stream = false")
    zipped = diagnose(timing([4000.0] * 100, headers={**via, "content-encoding": "gzip"}))
    assert zipped.hop is not None and zipped.hop.startswith("Varnish's gzip (beresp.do_gzip)")


def test_a_json_body_is_buffered():
    headers = {"content-type": "application/json"}
    assert diagnose(timing([900.0], streamed=False, headers=headers)).verdict == "buffered"


def test_incomplete_and_too_short_replies_are_failed():
    broken = timing(steady(100, 10.0), complete=False, error="stream ended without an end marker")
    assert diagnose(broken).verdict == "failed"
    assert "end marker" in diagnose(broken).reason
    assert diagnose(timing(steady(3, 10.0))).verdict == "failed"


def test_burst_gap_is_a_threshold_the_caller_sets():
    times = steady(100, 2.0)
    assert diagnose(timing(times), Thresholds(burst_gap_ms=3.0)).verdict != "streaming"
    assert diagnose(timing(times), Thresholds(burst_gap_ms=1.0)).verdict == "streaming"
    assert len(bursts_of(timing(times), 1.0)) == 100


@pytest.mark.parametrize("every_ms", [0.3, 1.0, 2.0, 10.0, 33.0])
def test_a_steady_stream_streams_whatever_the_source_pace(every_ms):
    # Events that arrive one read each are streaming, from a 0.3 ms-a-token source as from
    # a 33 ms one: the verdict must not assume a token time.
    times = steady(250, every_ms)
    times[100:104] = [times[104]] * 4  # and a stall on a busy machine merges a few
    result = diagnose(timing(times))
    assert result.verdict == "streaming", result.reason


def test_a_fast_source_held_by_a_buffer_is_still_bursty():
    # 1 ms a token, released 4 KiB (256 events) at a time: one read per release.
    times = [256.0] * 256 + [512.0] * 256 + [600.0] * 88
    result = diagnose(timing(times))
    assert result.verdict == "bursty"
    assert [b.events for b in result.bursts] == [256, 256, 88]


def test_compare_blames_the_hop_between_a_streaming_app_and_a_buffering_proxy():
    direct = diagnose(timing(steady(100, 10.0)))
    proxied = diagnose(timing([1000.0] * 100, headers={**SSE, "server": "nginx"}))
    assert "the app streams" in compare(direct, proxied)
    assert "fix the app" in compare(proxied, proxied)
    assert "both paths stream" in compare(direct, direct)


def test_a_burst_of_one_event_is_said_as_one():
    # Held, then a lone last event long after: its burst is "1 event", not "1 events".
    times = [1000.0 + 0.01 * i for i in range(100)] + [3000.0]
    result = diagnose(timing(times, headers={**SSE, "server": "nginx"}))
    assert result.verdict in ("bursty", "buffered"), result.verdict
    (shown,) = [line for line in describe(result) if line.lstrip().startswith("bursts:")]
    assert "100 events (~" in shown and "1 event (~" in shown, shown
