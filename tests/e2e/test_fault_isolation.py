"""Fault isolation in the engine core (issue 19, hardening): a fault while handling one
request (adding it, scheduling it, applying or detokenizing its results) fails that request
with an error and frees its KV blocks, while the core keeps serving the others (DESIGN.md
invariants 4 and 5: no block leaks, every request ends). A fault in batched device work that
no one request is known to have caused fails the requests of the steps involved, never the
core. A malformed or unexpected message to the core is dropped with a log line. With overlap
scheduling on and off."""

from __future__ import annotations

import logging

import msgpack
import pytest

from tandem import SamplingParams
from tandem.engine_process import EngineCoreProcess
from tandem.messages import TO_ENGINE, AbortRequests, AddRejected, AddRequest, MessageError, decode

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
FAULTY = 1  # the index of the request whose handling raises
# Overlap off and on; on, also with an MTP head (its steps launch in parts).
ENGINES = {
    "sequential": {"overlap": False},
    "overlap": {"overlap": True},
    "overlap-mtp": {"overlap": True, "speculative": "mtp", "num_speculative_tokens": 3},
}


class FaultyParams:
    """A request's sampling parameters whose ``attribute`` raises once the request has
    ``after`` output tokens (every other attribute is the real one's)."""

    def __init__(self, request, attribute: str, after: int):
        self._params = request.sampling_params
        self._request = request
        self._attribute = attribute
        self._after = after

    def __getattr__(self, name):
        if name == self._attribute and len(self._request.output_token_ids) >= self._after:
            raise RuntimeError(f"injected fault reading {name}")
        return getattr(self._params, name)


def _run(llm, request_ids: list[str]) -> dict[str, object]:
    """Step until every request in ``request_ids`` has finished; their final outputs."""
    finished = {}
    while len(finished) < len(request_ids):
        for output in llm.step(finished_only=True):
            finished[output.request_id] = output
    llm.engine.read_in_flight()  # settle the last step, as LLM.generate does
    llm.engine.step()
    return finished


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _run_with_fault(llm, attribute: str, after: int = 2):
    """The PROMPTS with request FAULTY's sampling parameter ``attribute`` raising after
    ``after`` tokens: (outputs by prompt, the error updates the core sent)."""
    ids = [llm.add_request(prompt, GREEDY) for prompt in PROMPTS]
    request = llm.engine.scheduler.requests[ids[FAULTY]]
    request.sampling_params = FaultyParams(request, attribute, after)
    errors = []
    step = llm.engine.step

    def recording_step():
        updates = step()
        errors.extend(u for u in updates if u.error is not None)
        return updates

    llm.engine.step = recording_step
    try:
        finished = _run(llm, ids)
    finally:
        del llm.engine.step
    return [finished[i] for i in ids], errors


@pytest.mark.parametrize("engine", ENGINES)
def test_a_fault_in_one_requests_stop_check_fails_only_that_request(make_llm, engine, caplog):
    llm = make_llm(**ENGINES[engine])
    clean = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with caplog.at_level(logging.ERROR):
        outputs, errors = _run_with_fault(llm, "max_tokens")  # read by the stop check
    assert outputs[FAULTY].outputs[0].finish_reason == "error"
    assert [e.request_id for e in errors] == [outputs[FAULTY].request_id]
    assert "injected fault reading max_tokens" in errors[0].error
    others = [i for i in range(len(PROMPTS)) if i != FAULTY]
    assert [_tokens(outputs)[i] for i in others] == [clean[i] for i in others]
    assert "injected fault" in caplog.text  # never silent
    # The engine serves on, with the same results.
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == clean


@pytest.mark.parametrize("engine", ENGINES)
def test_a_fault_in_batched_sampling_fails_that_steps_requests_and_the_engine_serves_on(
    make_llm, engine, caplog
):
    llm = make_llm(**ENGINES[engine])
    clean = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with caplog.at_level(logging.ERROR):
        outputs, errors = _run_with_fault(llm, "greedy")  # read while building the sampling
    # The fault is in the batch's device work: every request of the step fails.
    assert [o.outputs[0].finish_reason for o in outputs] == ["error"] * len(PROMPTS)
    assert sorted(e.request_id for e in errors) == sorted(o.request_id for o in outputs)
    assert all("internal error in a batched step" in e.error for e in errors)
    assert "fault in a batched step" in caplog.text
    assert llm.engine.pipeline.batch.states == {}  # the failed requests' worker state is gone
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == clean


class FaultyDetokenizer:
    """A request's incremental detokenizer that raises from its ``after``-th token on."""

    def __init__(self, detokenizer, after: int):
        self._detokenizer = detokenizer
        self._left = after

    def append(self, token_ids):
        self._left -= len(token_ids)
        if self._left < 0:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
        return self._detokenizer.append(token_ids)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_fault_detokenizing_one_request_fails_only_that_request(make_llm, overlap):
    llm = make_llm(overlap=overlap)
    clean = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    ids = [llm.add_request(prompt, GREEDY) for prompt in PROMPTS]
    state = llm.processor.states[ids[FAULTY]]
    state.detokenizer = FaultyDetokenizer(state.detokenizer, after=3)
    finished = _run(llm, ids)
    outputs = [finished[i] for i in ids]
    assert outputs[FAULTY].outputs[0].finish_reason == "error"
    assert ids[FAULTY] not in llm.engine.scheduler.requests  # ended in the core too
    others = [i for i in range(len(PROMPTS)) if i != FAULTY]
    assert [_tokens(outputs)[i] for i in others] == [clean[i] for i in others]
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == clean


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_add_raises_is_not_queued_and_the_others_run(
    make_llm, overlap, monkeypatch
):
    llm = make_llm(overlap=overlap)
    clean = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    engine = llm.engine
    limits = engine.limits
    bad_prompt = llm.tokenizer.encode(PROMPTS[FAULTY])

    class FaultyLimits:
        def validate(self, prompt_token_ids, sampling_params):
            if list(prompt_token_ids) == bad_prompt:
                raise RuntimeError("injected fault while adding")
            limits.validate(prompt_token_ids, sampling_params)

    monkeypatch.setattr(engine, "limits", FaultyLimits())
    ids = [llm.add_request(PROMPTS[0], GREEDY)]
    with pytest.raises(RuntimeError, match="injected fault"):
        llm.add_request(PROMPTS[FAULTY], GREEDY)
    assert len(engine.scheduler.requests) == 1
    ids.append(llm.add_request(PROMPTS[2], GREEDY))
    finished = _run(llm, ids)
    assert [list(finished[i].outputs[0].token_ids) for i in ids] == [clean[0], clean[2]]


class _FakeInputs:
    """A PULL socket's stand-in that holds some frames."""

    def __init__(self, frames: list[bytes]):
        self.frames = list(frames)

    def poll(self, timeout: int) -> bool:
        return bool(self.frames)

    def recv(self) -> bytes:
        return self.frames.pop(0)


def _process_loop(engine, frames: list[bytes]) -> tuple[EngineCoreProcess, list]:
    """An engine-core process's loop over ``engine`` (no sockets, nor a process): its input
    holds ``frames``; what it would send goes to the returned list."""
    proc = object.__new__(EngineCoreProcess)
    proc.core = engine
    proc.is_follower = False
    proc.followers = []
    proc.running = True
    proc.inputs = _FakeInputs(frames)
    sent: list = []
    proc._send = sent.append
    return proc, sent


GARBAGE_FRAMES = [
    b"\xc1",  # not msgpack
    msgpack.packb({(1, 2): 3}),  # a map whose key is a list (unhashable when decoded)
    msgpack.packb(["add", {"request_id": "x"}]),  # fields missing
    msgpack.packb(["add", {"request_id": 1, "prompt_token_ids": [1], "params": {}}]),
    msgpack.packb(["kv_ready", {"request_id": "x"}]),  # a PD message, not for the core
    msgpack.packb(["turn", {"messages": [5]}]),
]


@pytest.mark.parametrize("frame", GARBAGE_FRAMES)
def test_decode_raises_message_error_for_any_malformed_frame(frame):
    with pytest.raises(MessageError):
        decode(frame, TO_ENGINE)


@pytest.mark.parametrize("overlap", [False, True])
def test_malformed_messages_are_dropped_and_the_core_serves_on(make_llm, overlap, caplog):
    llm = make_llm(overlap=overlap)
    clean = _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    prompt = llm.tokenizer.encode(PROMPTS[0])
    good = AddRequest("good", prompt, llm._with_end_tokens(GREEDY)).encode()
    proc, sent = _process_loop(llm.engine, [*GARBAGE_FRAMES, good])
    with caplog.at_level(logging.WARNING):
        assert proc._drain_inputs(block=False) == 1
    assert caplog.text.count("dropped an input message") == len(GARBAGE_FRAMES)
    assert sent == []
    llm.processor.add_request("good", PROMPTS[0], prompt, llm._with_end_tokens(GREEDY))
    finished = _run(llm, ["good"])
    assert [list(finished["good"].outputs[0].token_ids)] == clean


def test_an_add_request_that_faults_is_rejected_and_the_core_serves_on(make_llm, monkeypatch):
    llm = make_llm(overlap=True)
    prompt = llm.tokenizer.encode(PROMPTS[0])
    params = llm._with_end_tokens(GREEDY)
    proc, sent = _process_loop(llm.engine, [])
    add = llm.engine.add_request
    monkeypatch.setattr(
        llm.engine, "add_request", lambda request: (_ for _ in ()).throw(KeyError("injected"))
    )
    proc._handle(AddRequest("bad", prompt, params))
    assert len(sent) == 1 and isinstance(sent[0], AddRejected)
    assert sent[0].request_id == "bad" and "KeyError" in sent[0].error
    monkeypatch.setattr(llm.engine, "add_request", add)
    proc._handle(AbortRequests(["not-a-request"]))  # unknown ids are ignored
    proc._handle(AddRequest("good", prompt, params))
    assert "good" in llm.engine.scheduler.requests and len(sent) == 1
    llm.processor.add_request("good", PROMPTS[0], prompt, params)
    _run(llm, ["good"])
