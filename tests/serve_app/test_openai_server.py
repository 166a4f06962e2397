"""OpenAIServer without HTTP: incremental detokenization, stop strings, parameter checks against the
served model, SamplingParams, chat templates, engine errors, logprobs and closing the engine stream.
The tokenizer is SmolLM2's real one; the engine is the scripted fake."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.openai.detokenizer import IncrementalDetokenizer
from serve_app.openai.errors import OpenAIError
from serve_app.openai.output_text import OutputText, StopStringBuffer
from serve_app.openai.render import DONE_EVENT
from serve_app.openai.requests import ChatCompletionRequest, CompletionRequest
from serve_app.openai.server import EventStream, OpenAIServer
from serve_app.unit_api import EngineError, GenerateChunk
from tests.serve_app.openai_fakes import EOS, MODEL, FakeEngine

pytestmark = pytest.mark.anyio
MULTIBYTE = ["héllo 😀 世界 ok", "日本語のテキスト🎉🎉 and 👨‍👩‍👧 family", "naïve café — ½ ∑ 𝔘𝔫𝔦", "a\n\n\tb  c"]


def server_for(tok: Any, **engine_kw: Any) -> tuple[OpenAIServer, FakeEngine]:
    engine = FakeEngine(tok, **engine_kw)
    return OpenAIServer(engine, tok, model_aliases=["smol"]), engine


def incremental(tok: Any, prompt_ids: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids)
    return [detok.add(t) for t in ids] + [detok.flush()]


# ---- incremental detokenization ------------------------------------------------------------


@pytest.mark.parametrize("text", MULTIBYTE)
def test_incremental_equals_full_decode_without_replacement_chars(tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    deltas = incremental(tok, tok.encode("Say:", add_special_tokens=False), ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    if not text.isascii():
        assert sum(1 for d in deltas if d == "") > 1  # multi-byte characters really were split over tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=40))
def test_incremental_equals_full_decode_for_any_text(tok: Any, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(incremental(tok, [19556], ids)) == tok.decode(ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(min_value=3, max_value=49151), min_size=1, max_size=30))
def test_incremental_equals_full_decode_for_any_ids(tok: Any, ids: list[int]) -> None:
    # Random ids include lone UTF-8 fragments: held back while dangling, never lost.
    assert "".join(incremental(tok, [], ids)) == tok.decode(ids, skip_special_tokens=True)


def test_sentencepiece_spacing_comes_from_the_prompt_context() -> None:
    """Metaspace ("▁word") tokenizers drop a token's leading space when it is decoded alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "▁again", "!"]
    backend = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    sp = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    ids = sp.encode("Hello world again!", add_special_tokens=False)
    assert [sp.decode([i]) for i in ids] == ["Hello", "world", "again", "!"]  # per-token decode loses spaces
    assert incremental(sp, ids[:1], ids[1:]) == [" world", " again", "!", ""]


def test_special_tokens_are_skipped_by_default(tok: Any) -> None:
    ids = [*tok.encode("Hi", add_special_tokens=False), EOS]
    assert "".join(incremental(tok, [], ids)) == "Hi"


# ---- stop strings ------------------------------------------------------------------------------


def test_stop_string_split_over_deltas_is_never_half_sent() -> None:
    buf = StopStringBuffer(["END"])
    sent = []
    for piece in ["abc E", "N", "D tail"]:
        matched = buf.append(piece)
        sent.append(buf.take())
    assert matched and buf.text == "abc " and "".join(sent) == "abc "
    assert not any("E" in s for s in sent)


def test_stop_string_earliest_match_wins_and_can_be_kept() -> None:
    buf = StopStringBuffer(["yz", "x"])
    assert buf.append("abxyz") and buf.text == "ab" and buf.matched == "x"
    keep = StopStringBuffer(["yz"], include_stop=True)
    assert keep.hold == 0 and keep.append("ab") is False and keep.take() == "ab"
    assert keep.append("cyzd") and keep.text == "abcyz" and keep.take() == "cyz"


def test_held_text_is_released_at_the_end() -> None:
    buf = StopStringBuffer(["STOP"])
    assert not buf.append("hello ST")
    assert buf.take() == "hello"
    assert buf.take(final=True) == " ST"


def test_output_text_stop_split_over_two_tokens(tok: Any) -> None:
    ids = tok.encode("Hello world, again", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids[:2]] == ["Hello", " world"]
    out = OutputText(tok, [], ["o w"])
    first = out.on_chunk([ids[0]])
    assert first.text == "Hel" and first.finish_reason is None  # "lo" held: it may start "o w"
    second = out.on_chunk([ids[1]])
    assert second.text == "l" and second.finish_reason == "stop" and out.text == "Hell" and out.num_tokens == 2
    with pytest.raises(RuntimeError):
        out.on_chunk([ids[2]])


def test_min_tokens_defers_stop_strings(tok: Any) -> None:
    ids = tok.encode("a b a b", add_special_tokens=False)
    out = OutputText(tok, [], ["b"], min_tokens=3)
    text = "".join(out.on_chunk([i]).text for i in ids)
    assert out.finish_reason == "stop" and text == "a b a "


# ---- the server --------------------------------------------------------------------------------


async def collect(stream: EventStream) -> list[str]:
    return [event async for event in stream]


async def test_non_stream_aggregates_the_reply(tok: Any) -> None:
    server, engine = server_for(tok, tokens_per_chunk=3)
    resp = await server.create_completion(CompletionRequest(prompt="Say hi", max_tokens=50))
    assert not isinstance(resp, EventStream)
    assert resp.choices[0].text == "Hello there! How can I help?" and resp.choices[0].finish_reason == "stop"
    prompt_ids = tok.encode("Say hi")
    assert engine.requests[0].prompt_token_ids == prompt_ids
    assert resp.usage is not None and resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(engine.reply_ids) + 1  # EOS counts, as in vLLM
    assert engine.completed == [resp.id]


async def test_sampling_params_from_the_request(tok: Any) -> None:
    server, engine = server_for(tok)
    await server.create_completion(CompletionRequest(prompt="x", temperature=0, top_k=0, seed=7, min_tokens=1,
                                                     stop_token_ids=[5]))
    sp = engine.requests[0].sampling
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.min_tokens) == (0.0, 1.0, -1, 7, 1)
    assert sp.max_tokens == 16 and sp.stop_token_ids == frozenset({5, EOS}) and sp.logprobs is None
    await server.create_completion(CompletionRequest(prompt="x", ignore_eos=True, max_tokens=20))
    sp = engine.requests[1].sampling
    assert sp.ignore_eos and EOS not in sp.stop_token_ids and sp.max_tokens == 20
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not sp.has_penalties
    await server.create_completion(CompletionRequest(prompt="x", presence_penalty=-0.5, frequency_penalty=1.25,
                                                     repetition_penalty=1.1))
    sp = engine.requests[2].sampling
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (-0.5, 1.25, 1.1)


async def test_stop_string_truncates_and_closes_the_engine_stream(tok: Any) -> None:
    server, engine = server_for(tok, reply="one two three four", forever=True)
    resp = await server.create_completion(CompletionRequest(prompt="count", stop=[" thr"], max_tokens=1000))
    assert not isinstance(resp, EventStream)
    assert resp.choices[0].text == "one two" and resp.choices[0].finish_reason == "stop"
    assert engine.closed_early == [resp.id]  # a stream that never ends was cancelled, not drained


async def test_stop_string_in_a_stream_closes_the_engine_stream(tok: Any) -> None:
    server, engine = server_for(tok, reply="one two three four", forever=True)
    stream = await server.create_completion(CompletionRequest(prompt="count", stop="three", stream=True))
    assert isinstance(stream, EventStream)
    events = await collect(stream)
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == "one two " and events[-1] == DONE_EVENT
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "stop"
    assert engine.closed_early == [stream.request_id]


@pytest.mark.parametrize(("max_model_len", "kw", "param", "numbers"), [
    (8, {"prompt": "one two three four five six seven eight nine"}, "prompt", ["is 9 tokens", "8 tokens"]),
    (12, {"prompt": "one two three four", "max_tokens": 10}, "max_tokens", ["14 tokens", "4 in the prompt", "10 in"]),
])
async def test_context_length_errors_name_both_numbers(tok: Any, max_model_len: int, kw: dict[str, Any],
                                                       param: str, numbers: list[str]) -> None:
    server, engine = server_for(tok, max_model_len=max_model_len)
    with pytest.raises(OpenAIError) as info:
        await server.create_completion(CompletionRequest(**kw))
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, "context_length_exceeded")
    assert all(n in err.message for n in numbers) and str(max_model_len) in err.message
    assert engine.requests == []


async def test_default_max_tokens_is_capped_to_the_context_left(tok: Any) -> None:
    server, engine = server_for(tok, max_model_len=10)
    await server.create_completion(CompletionRequest(prompt="one two three four"))
    assert engine.requests[0].sampling.max_tokens == 6
    server, engine = server_for(tok, max_model_len=100)
    await server.create_chat_completion(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]))
    assert engine.requests[0].sampling.max_tokens == 100 - len(engine.requests[0].prompt_token_ids)


@pytest.mark.parametrize(("request_kw", "param", "needle"), [
    ({"model": "gpt-4"}, "model", "'gpt-4' does not exist"),
    ({"prompt": [5, 60000]}, "prompt", "60000 is outside the vocabulary"),
    ({"stop_token_ids": [49152]}, "stop_token_ids", "outside the vocabulary"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens", "min_tokens=20"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"echo": True, "logprobs": 1}, "echo", "not supported"),
])
async def test_request_errors_found_by_the_server(tok: Any, request_kw: dict[str, Any], param: str,
                                                  needle: str) -> None:
    server, engine = server_for(tok)
    with pytest.raises(OpenAIError) as info:
        await server.create_completion(CompletionRequest(**{"prompt": "hi", **request_kw}))
    assert (info.value.status, info.value.type, info.value.param) == (400, "invalid_request_error", param)
    assert needle in info.value.message and engine.requests == []


async def test_model_id_and_alias_are_accepted(tok: Any) -> None:
    server, _ = server_for(tok)
    for name in (MODEL, "smol", None):
        resp = await server.create_completion(CompletionRequest(prompt="x", model=name))
        assert not isinstance(resp, EventStream) and resp.model == MODEL
    assert [card.id for card in server.list_models().data] == [MODEL, "smol"]


async def test_chat_template_is_applied(tok: Any) -> None:
    server, engine = server_for(tok)
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    resp = await server.create_chat_completion(ChatCompletionRequest(messages=messages))
    expected = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                       add_generation_prompt=True, tokenize=False)
    assert expected.endswith("<|im_start|>assistant\n")
    assert engine.requests[0].prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert not isinstance(resp, EventStream) and resp.choices[0].message.content == "Hello there! How can I help?"


@pytest.mark.parametrize(("status", "retry"), [(429, 2.2), (503, None), (400, None)])
async def test_first_chunk_error_is_raised_before_any_event(tok: Any, status: int, retry: float | None) -> None:
    err = EngineError(status, "", "queue_full", "too busy", retry)
    server, engine = server_for(tok, first_error=err)
    with pytest.raises(OpenAIError) as info:
        await server.create_completion(CompletionRequest(prompt="x", stream=True))
    got = info.value
    assert (got.status, got.code, got.message) == (status, "queue_full", "too busy")
    assert got.type == {429: "rate_limit_error", 503: "server_error", 400: "invalid_request_error"}[status]
    assert got.headers() == ({"Retry-After": "3"} if status == 429 else {"Retry-After": "1"} if status == 503 else {})
    await asyncio.wait_for(engine.closed.wait(), 5)


async def test_error_after_first_token_is_an_sse_event(tok: Any) -> None:
    server, _ = server_for(tok, error_after=2)
    stream = await server.create_chat_completion(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                                                       stream=True))
    assert isinstance(stream, EventStream)
    events = await collect(stream)
    assert events[-1] == DONE_EVENT
    error = json.loads(events[-2][6:])
    assert error == {"error": {"message": "worker died", "type": "server_error", "param": None,
                               "code": "engine_failed"}}
    assert "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-2]) == "Hello there"


async def test_abort_is_an_error_not_a_truncated_success(tok: Any) -> None:
    class Aborting(FakeEngine):
        async def generate(self, request: Any) -> Any:
            yield GenerateChunk([19556], "abort")

    engine = Aborting(tok)
    with pytest.raises(OpenAIError) as info:
        await OpenAIServer(engine, tok).create_completion(CompletionRequest(prompt="x"))
    assert (info.value.status, info.value.code) == (503, "engine_aborted")


async def test_request_timeout_aborts_the_engine_request(tok: Any) -> None:
    engine = FakeEngine(tok, forever=True, delay_s=3600)
    server = OpenAIServer(engine, tok, request_timeout_s=0.05)
    with pytest.raises(OpenAIError) as info:
        await server.create_completion(CompletionRequest(prompt="x"))
    assert (info.value.status, info.value.code) == (504, "request_timeout")
    assert len(engine.closed_early) == 1


async def test_completion_logprobs_and_echo(tok: Any) -> None:
    server, _ = server_for(tok, reply="Hi there")
    resp = await server.create_completion(CompletionRequest(prompt="Say", logprobs=2, max_tokens=2))
    assert not isinstance(resp, EventStream)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens == ["Hi", " there"] and lp.token_logprobs == [-0.5, -0.5]
    assert lp.text_offset == [0, 2] and lp.top_logprobs[0] == {"Hi": -0.5, tok.decode([100]): -2.0}
    echoed = await server.create_completion(CompletionRequest(prompt="Say", echo=True, max_tokens=2))
    assert not isinstance(echoed, EventStream) and echoed.choices[0].text == "SayHi there"


async def test_chat_logprobs_show_top_logprobs_alternatives(tok: Any) -> None:
    server, engine = server_for(tok, reply="Hi")
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2)
    resp = await server.create_chat_completion(req)
    assert engine.requests[0].sampling.logprobs == 2
    assert not isinstance(resp, EventStream) and resp.choices[0].logprobs is not None
    content = resp.choices[0].logprobs.content
    assert content is not None and content[0].token == "Hi" and content[0].bytes == list(b"Hi")
    assert [t.logprob for t in content[0].top_logprobs] == [-0.5, -2.0]
    assert content[-1].token == "<|im_end|>"


async def test_closing_an_unstarted_event_stream_cancels_the_request(tok: Any) -> None:
    server, engine = server_for(tok, forever=True)
    stream = await server.create_completion(CompletionRequest(prompt="x", stream=True))
    assert isinstance(stream, EventStream)
    await stream.aclose()
    assert engine.closed_early == [stream.request_id]


async def test_health(tok: Any) -> None:
    assert await server_for(tok)[0].health()
    assert not await server_for(tok, healthy=False)[0].health()
    assert not await server_for(tok, healthy=RuntimeError("dead actor"))[0].health()


async def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(tok: Any) -> None:
    server, engine = server_for(tok, max_model_len=64)
    bound = server.prompts.max_token_chars
    assert bound >= max(len(t) for t in tok.get_vocab())
    calls: list[Any] = []
    encode = server.prompts.completion_ids
    server.prompts.completion_ids = lambda p: calls.append(p) or encode(p)  # type: ignore[method-assign]
    with pytest.raises(OpenAIError) as info:
        await server.create_completion(CompletionRequest(prompt="x" * (2 * bound * 64)))
    assert (info.value.status, info.value.code) == (400, "context_length_exceeded")
    assert calls == [] and engine.requests == []
    # Just under the bound the tokenizer decides (and counts the tokens).
    with pytest.raises(OpenAIError) as info:
        await server.create_completion(CompletionRequest(prompt="x" * (2 * bound * 64 - 1)))
    assert len(calls) == 1 and "tokens long" in info.value.message
