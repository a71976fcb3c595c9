"""Random traffic for the soak test, drawn from one seeded generator so that a failure
reproduces: valid completions and chat requests with random sampling fields, streaming or
not, some from clients that hang up part way; bodies a client gets wrong; bursts of
requests that hold their slots, sent at once to overflow the waiting queue. And the checks
that every answer has OpenAI's shape."""

import json
import random
from dataclasses import dataclass, field

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "List three animals:\n1.",
    "A haiku about autumn:\n",
    "Once upon a time",
]
STOPS = ["\n", ".", " the", ",", "!!", "zz"]


@dataclass
class Plan:
    """One request: what to send, and what a client does with the answer."""

    path: str
    body: dict | None = None  # sent as JSON
    raw: bytes | None = None  # sent as it is, as a JSON body
    method: str = "POST"
    valid: bool = True  # False: a 4xx is the only right answer
    choices: int = 1  # choices a whole answer must have
    hang_up_after: int | None = None  # streams: events read before closing; else seconds
    expect: dict = field(default_factory=dict)  # usage chunk, logprobs


def sampling(rng: random.Random) -> dict:
    fields: dict = {"max_tokens": rng.randint(1, 8)}
    if rng.random() < 0.7:
        fields["temperature"] = rng.choice([0.0, 0.5, 1.0, 1.5])
    if rng.random() < 0.4:
        fields["top_p"] = rng.choice([0.3, 0.9, 1.0])
    if rng.random() < 0.4:
        fields["top_k"] = rng.choice([-1, 0, 1, 5, 50])
    if rng.random() < 0.5:
        fields["seed"] = rng.randrange(2**32)
    if rng.random() < 0.3:
        fields["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    fields["n"] = rng.choice([1, 1, 2, 3])
    return fields


def completion_plan(rng: random.Random) -> Plan:
    prompts = rng.sample(PROMPTS, rng.choice([1, 1, 2]))
    body = {"prompt": prompts[0] if len(prompts) == 1 else prompts, **sampling(rng)}
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.15:
        body["echo"] = True
    return Plan("/v1/completions", body, choices=body["n"] * len(prompts))


def chat_plan(rng: random.Random) -> Plan:
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "Answer in one word."})
    body = {"messages": messages, **sampling(rng)}
    if rng.random() < 0.3:
        body["max_completion_tokens"] = body.pop("max_tokens")
    if rng.random() < 0.3:
        body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    return Plan("/v1/chat/completions", body, choices=body["n"])


def invalid_plan(rng: random.Random, max_request_bytes: int) -> Plan:
    completion = {"prompt": "Hi", "max_tokens": 2}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    wrong = rng.choice(
        [
            {"temperature": 3},
            {"top_p": 0},
            {"n": 0},
            {"max_tokens": -1},
            {"top_k": -5},
            {"max_tokens": 10**6},
            {"model": "no-such-model"},
            {"stop": [""]},
            {"n": "two"},
        ]  # fmt: skip
    )
    kind = rng.randrange(6)
    if kind == 0:
        return Plan("/v1/chat/completions", {**chat, **wrong}, valid=False)
    if kind == 1:
        return Plan("/v1/chat/completions", {"messages": []}, valid=False)
    if kind == 2:
        return Plan("/v1/completions", raw=b'{"prompt": "Hi", "max_tokens":', valid=False)
    if kind == 3:  # over the body bound: 413
        return Plan("/v1/completions", {"prompt": "a" * max_request_bytes}, valid=False)
    if kind == 4:
        return Plan("/v1/completions", method="GET", valid=False)
    return Plan("/v1/completions", {**completion, **wrong}, valid=False)


def random_plan(rng: random.Random, max_request_bytes: int) -> Plan:
    if rng.random() < 0.2:
        return invalid_plan(rng, max_request_bytes)
    plan = completion_plan(rng) if rng.random() < 0.5 else chat_plan(rng)
    if rng.random() < 0.5:
        plan.body["stream"] = True
        if rng.random() < 0.5:
            plan.body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.25:
            plan.hang_up_after = rng.randint(1, 3)
    elif rng.random() < 0.1:
        plan.hang_up_after = rng.uniform(0.01, 0.3)
    return plan


def burst_plan(rng: random.Random) -> Plan:
    """Holds a running slot for several steps, so that a burst outgrows the queue."""
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": 8, "ignore_eos": True}
    return Plan("/v1/completions", body)


# ---- checks: each returns what is wrong with an answer, or None ------------------------


def error_problem(status: int, content_type: str, text: str) -> str | None:
    if not content_type.startswith("application/json"):
        return f"{status} error is {content_type}: {text[:200]}"
    body = json.loads(text)
    error = body.get("error") if isinstance(body, dict) else None
    if set(body) != {"error"} or set(error or {}) != {"message", "type", "param", "code"}:
        return f"{status} error body not in OpenAI's shape: {text[:200]}"
    if not error["message"] or "Traceback" in error["message"]:
        return f"{status} error message: {error['message']!r}"
    return None


def answer_problem(plan: Plan, body: dict) -> str | None:
    chat = plan.path.endswith("chat/completions")
    if body.get("object") != ("chat.completion" if chat else "text_completion"):
        return f"object {body.get('object')!r}"
    choices = body["choices"]
    if sorted(c["index"] for c in choices) != list(range(plan.choices)):
        return f"choice indices {[c['index'] for c in choices]}, wanted {plan.choices}"
    for c in choices:
        if c["finish_reason"] not in ("stop", "length"):
            return f"finish_reason {c['finish_reason']!r}"
        if not isinstance(c["message"]["content"] if chat else c["text"], str):
            return "choice without text"
        asked = plan.body.get("logprobs") is not None and plan.body["logprobs"] is not False
        if asked != (c.get("logprobs") is not None):
            return "logprobs asked for and missing, or the other way round"
    usage = body["usage"]
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return f"usage does not add up: {usage}"
    return None


def stream_problem(plan: Plan, raw: bytes) -> str | None:
    text = raw.decode("utf-8")
    if not text.endswith("\n\n"):
        return f"stream cut short: {text[-200:]!r}"
    events = text[:-2].split("\n\n")
    if any(not e.startswith("data: ") or "\n" in e for e in events):
        return "an event not framed as `data: <json>`"
    payloads = [e[len("data: ") :] for e in events]
    if payloads[-1] != "[DONE]" or "[DONE]" in payloads[:-1]:
        return "stream does not end with exactly one data: [DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    chat = plan.path.endswith("chat/completions")
    wanted = "chat.completion.chunk" if chat else "text_completion"
    if any(c.get("object") != wanted for c in chunks):
        return f"a chunk whose object is not {wanted}"
    finished = [ch["index"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    if sorted(finished) != list(range(plan.choices)):
        return f"finish reasons for choices {sorted(finished)}, wanted {plan.choices}"
    usage_chunks = [c for c in chunks if c.get("usage")]
    if bool(usage_chunks) != bool(plan.body.get("stream_options")):
        return "usage chunk asked for and missing, or the other way round"
    if usage_chunks and (usage_chunks[-1] is not chunks[-1] or chunks[-1]["choices"]):
        return "usage chunk is not the last one, or has choices"
    return None
