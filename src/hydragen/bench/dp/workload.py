"""The workload of ``hydragen bench dp``: tenants with long system prompts, their users' multi-turn chats.

Many tenants (companies running an assistant) each have a system prompt of 1-2K tokens: a support
assistant's brief, product catalogue, policies and FAQ, different text for every tenant from its first
sentence on. Each tenant has many users; chat *sessions* start as a Poisson process, each picks a tenant and
one of its users, and runs 1 to ``max_turns`` turns: a turn sends the whole history (system prompt, earlier
questions and the answers the server gave) plus a new question, after a think time that starts when the
previous answer ended. Every turn carries the settings real clients send: a temperature (some greedy), a
top_p, sometimes stop strings, and a mixed ``max_tokens``.

Everything is a function of the seed: the same spec gives the same tenants, sessions, questions, settings
and times in every run and for every routing policy (the answers come from the server, so later turns'
prompts hold whatever the model wrote).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


def _items(text: str) -> list[str]:
    return text.split("|")


INDUSTRIES = {
    "outdoor gear": ["tent", "backpack", "sleeping bag", "headlamp", "stove", "trekking pole", "rain jacket"],
    "home appliances": ["dishwasher", "air fryer", "blender", "washing machine", "heat pump", "vacuum"],
    "bicycles": ["gravel bike", "cargo bike", "helmet", "e-bike battery", "tubeless tyre", "bike lock"],
    "consumer banking": ["savings account", "credit card", "mortgage", "travel insurance", "debit card"],
    "telecom": ["fibre plan", "mobile plan", "router", "eSIM", "roaming pack", "mesh extender"],
    "software": ["team plan", "API quota", "SSO add-on", "audit log", "data export", "mobile app"],
    "furniture": ["standing desk", "sofa", "bookshelf", "office chair", "bed frame", "dining table"],
    "pet care": ["grain-free kibble", "cat tree", "GPS collar", "litter box", "dog bed", "aquarium filter"],
    "travel": ["city break", "rail pass", "ski package", "cruise cabin", "airport transfer", "hostel bed"],
    "energy": ["solar panel", "home battery", "smart meter", "heat pump tariff", "EV charger"],
}
CITIES = _items(
    "Lisbon|Tampere|Ghent|Porto Alegre|Osaka|Leeds|Graz|Halifax|Cork|Pune|Bergen|Adelaide|Lyon|"
    "Denver|Kraków|Valencia|Aarhus|Quito|Turin|Dundee"
)
SYLLABLES = _items("ka|lo|mer|vin|ta|sol|dra|nex|qu|ri|bel|os|zan|tor|mi|lux|ver|an|sky|pol")
FIRST_NAMES = _items(
    "Ana|Ben|Chloé|Dmitri|Esi|Farah|Goran|Hina|Ivo|Jana|Kofi|Lena|Mateo|Nora|Omar|Priya|Rui|Sara|"
    "Tomás|Uma|Wen|Yara"
)
ADJECTIVES = _items(
    "lightweight|durable|compact|quiet|affordable|premium|modular|certified|energy-efficient|"
    "weatherproof|refurbished|bestselling|entry-level|professional"
)
AUDIENCES = _items(
    "families|students|small businesses|first-time buyers|frequent travellers|professionals|"
    "retirees|beginners|enthusiasts|people working from home"
)
TONES = _items(
    "Be warm but brief.|Use plain words and short sentences.|Never invent prices or dates.|"
    "Ask one clarifying question when a request is ambiguous.|Quote order numbers back exactly.|"
    "Offer a human agent when the customer is upset.|Do not give legal or medical advice.|"
    "Answer in the customer's language.|Summarise long answers with a bulleted list.|"
    "Apologise once, not repeatedly.|Mention the relevant policy section by name."
)
REGIONS = _items("the mainland|the islands|the EU|the UK|North America|the rest of the world")
ISSUES = _items(
    "arrived damaged|stopped working after a week|is missing a part|was charged twice|"
    "does not match the description|makes a strange noise|was delivered to the wrong address|"
    "cannot be registered online|keeps disconnecting|is slower than advertised"
)
QUESTIONS = _items(
    "Can I return the {p} I bought {n} days ago?|How long does shipping to {r} take?|"
    "Which {p} would you recommend for {a}?|My {p} {i}. What should I do?|"
    "Is there a discount on the {p} if I buy two?|What does the warranty on the {p} cover?|"
    "Can I change the delivery date of my {p} order?|How do I cancel my {p}?|"
    "Is the {p} in stock in {c}?|What is the difference between the {p} and the {q}?"
)
FOLLOW_UPS = _items(
    "Thanks. And what if I lost the receipt?|OK. How much would that cost me?|"
    "Could you explain that step by step?|Can you put that in a short list?|"
    "What about the {p} instead?|Is that also true for orders from {r}?|"
    "Sorry, I did not understand. Can you say it more simply?|Great, and how long will it take?"
)
DETAILS = _items(
    "My order number is {o}.|I have been a customer since {y}.|I live in {c}.|"
    "I already tried restarting it.|The box was unopened.|I paid by card.|"
    "It was a gift for my sister.|I need it before the weekend.|I read your FAQ first."
)
STOPS = (("\nUser:",), ("\n\n\n", "<|endoftext|>"), ("###",))
OUTPUT_LENGTHS = ((32, 0.3), (64, 0.35), (128, 0.25), (256, 0.1))  # max_tokens: share of turns


@dataclass(frozen=True)
class WorkloadSpec:
    tenants: int = 16
    users_per_tenant: int = 24
    sessions: int = 96
    rate: float = 0.5  # sessions started per second (Poisson)
    system_tokens: tuple[int, int] = (1024, 2048)  # a tenant's system prompt length, uniform in [lo, hi]
    max_turns: int = 4
    continue_p: float = 0.55  # chance a session goes on after each turn (up to max_turns)
    think_s: float = 2.0  # mean pause between an answer and the next question (exponential)
    output_lengths: tuple[tuple[int, float], ...] = OUTPUT_LENGTHS  # (max_tokens, share of turns)
    seed: int = 0


@dataclass(frozen=True)
class Tenant:
    index: int
    company: str
    industry: str
    system_prompt: str
    system_tokens: int


@dataclass(frozen=True)
class Turn:
    question: str
    delay_s: float  # after the previous answer (the first turn: after the session's start)
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...] | None
    seed: int | None

    def sampling(self) -> dict:
        """The OpenAI request fields of this turn's settings."""
        body = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p}
        if self.stop:
            body["stop"] = list(self.stop)
        if self.seed is not None:
            body["seed"] = self.seed
        return body


@dataclass(frozen=True)
class Session:
    index: int
    tenant: int
    user: int  # the user's index within its tenant
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    tenants: tuple[Tenant, ...]
    sessions: tuple[Session, ...]
    stats: dict = field(default_factory=dict)

    def messages(self, session: Session, turn: int, answers: list[str]) -> list[dict]:
        """The chat a client sends for ``turn`` of ``session``: system prompt, the earlier turns with the
        answers it got (``answers[k]`` for turn k < ``turn``), and the new question."""
        if len(answers) < turn:
            raise ValueError(f"turn {turn} needs the {turn} earlier answers, got {len(answers)}")
        msgs = [{"role": "system", "content": self.tenants[session.tenant].system_prompt}]
        for k in range(turn):
            msgs += [
                {"role": "user", "content": session.turns[k].question},
                {"role": "assistant", "content": answers[k]},
            ]
        return msgs + [{"role": "user", "content": session.turns[turn].question}]

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def make_workload(spec: WorkloadSpec, count_tokens: Callable[[str], int]) -> Workload:
    """The workload for ``spec``; ``count_tokens`` measures a system prompt (the served model's tokenizer),
    so each tenant's prompt is grown section by section until it reaches its drawn length."""
    if spec.tenants < 1 or spec.users_per_tenant < 1 or spec.sessions < 1:
        raise ValueError("a workload needs at least one tenant, one user per tenant and one session")
    if spec.rate <= 0 or spec.think_s < 0 or not 0 <= spec.continue_p < 1 or spec.max_turns < 1:
        raise ValueError("rate must be > 0, think_s >= 0, continue_p in [0, 1) and max_turns >= 1")
    lo, hi = spec.system_tokens
    if not 0 < lo <= hi:
        raise ValueError(f"system_tokens must be 0 < low <= high, got {spec.system_tokens}")
    rng = random.Random(spec.seed)
    tenants = tuple(_tenant(i, rng, rng.randint(lo, hi), hi, count_tokens) for i in range(spec.tenants))
    sessions, t = [], 0.0
    for i in range(spec.sessions):
        t += rng.expovariate(spec.rate)
        tenant = rng.randrange(spec.tenants)
        user = rng.randrange(spec.users_per_tenant)
        n_turns = 1
        while n_turns < spec.max_turns and rng.random() < spec.continue_p:
            n_turns += 1
        turns = tuple(_turn(rng, spec, tenants[tenant], user, k) for k in range(n_turns))
        sessions.append(Session(i, tenant, user, t, turns))
    stats = {
        "system_tokens_total": sum(x.system_tokens for x in tenants),
        "system_tokens_min": min(x.system_tokens for x in tenants),
        "system_tokens_max": max(x.system_tokens for x in tenants),
        "requests": sum(len(s.turns) for s in sessions),
        "multi_turn_sessions": sum(len(s.turns) > 1 for s in sessions),
        "distinct_users": len({(s.tenant, s.user) for s in sessions}),
        "tenants_used": len({s.tenant for s in sessions}),
        "arrival_span_s": sessions[-1].start_s,
    }
    return Workload(spec, tenants, tuple(sessions), stats)


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _tenant(
    index: int, rng: random.Random, target: int, high: int, count_tokens: Callable[[str], int]
) -> Tenant:
    """A support assistant's brief, grown section by section until it has ``target`` tokens or more (and
    no more than ``high``)."""
    industry = rng.choice(list(INDUSTRIES))
    company = f"{_name(rng)} {rng.choice(['Outfitters', 'Labs', '& Co', 'Group', 'Direct', 'Works'])}"
    city = rng.choice(CITIES)
    head = (
        f"You are {_name(rng)}, the customer assistant of {company}, a {industry} company based in {city} "
        f"(tenant {index}). You answer customers' questions about orders, products and policies. "
        + " ".join(rng.sample(TONES, 4))
    )
    parts = [head, "\n\n## Products\n"]
    sections = [_product, _policy, _faq]
    estimate = count_tokens("".join(parts))  # sections start at a line break: their counts add up
    while estimate < target:
        parts.append(rng.choice(sections)(rng, industry, company))
        estimate += count_tokens(parts[-1])
    while len(parts) > 2 and count_tokens("".join(parts)) > high:
        parts.pop()  # the last section overshot the range
    text = "".join(parts)
    return Tenant(index, company, industry, text, count_tokens(text))


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _product(rng: random.Random, industry: str, company: str) -> str:
    p = rng.choice(INDUSTRIES[industry])
    sku = f"{rng.choice('ABCDEFGHKMPRSTX')}{rng.randint(100, 999)}-{rng.randint(10, 99)}"
    return (
        f"- {_name(rng)} {p} ({sku}): {_a(rng.choice(ADJECTIVES))} {p} for {rng.choice(AUDIENCES)}. Price "
        f"{rng.randint(9, 2400)}.{rng.choice(['00', '50', '99'])} EUR, warranty {rng.randint(1, 5)} years, "
        f"in stock in {rng.randint(1, 40)} stores; {rng.choice(ADJECTIVES)} and {rng.choice(ADJECTIVES)}.\n"
    )


def _policy(rng: random.Random, industry: str, company: str) -> str:
    region = rng.choice(REGIONS)
    return (
        f"\nPolicy {rng.randint(1, 30)}.{rng.randint(1, 9)} ({region}): orders ship within "
        f"{rng.randint(1, 5)} working days and arrive in {rng.randint(2, 14)} days; returns are accepted for "
        f"{rng.choice([14, 30, 60, 90])} days when the item is unused, and refunds take {rng.randint(3, 10)} "
        f"days. An item that {rng.choice(ISSUES)} is replaced free of charge by {company}.\n"
    )


def _faq(rng: random.Random, industry: str, company: str) -> str:
    p, q = rng.sample(INDUSTRIES[industry], 2)
    question = rng.choice(QUESTIONS).format(
        p=p, q=q, n=rng.randint(2, 80), r=rng.choice(REGIONS), a=rng.choice(AUDIENCES),
        i=rng.choice(ISSUES), c=rng.choice(CITIES),
    )  # fmt: skip
    return (
        f"\nQ: {question}\nA: See the {p} entry above; if unsure, give the customer the "
        f"{rng.choice(['returns', 'shipping', 'warranty', 'billing'])} link and the code "
        f"{rng.randint(1000, 9999)}.\n"
    )


def _turn(rng: random.Random, spec: WorkloadSpec, tenant: Tenant, user: int, k: int) -> Turn:
    products = INDUSTRIES[tenant.industry]
    fill = dict(
        p=rng.choice(products), q=rng.choice(products), n=rng.randint(2, 80), r=rng.choice(REGIONS),
        a=rng.choice(AUDIENCES), i=rng.choice(ISSUES), c=rng.choice(CITIES),
        o=f"{tenant.index:02d}-{user:04d}-{rng.randint(10000, 99999)}", y=rng.randint(2009, 2025),
    )  # fmt: skip
    if k == 0:
        who = f"Hi, this is {FIRST_NAMES[user % len(FIRST_NAMES)]} (customer {user})."
        details = " ".join(d.format(**fill) for d in rng.sample(DETAILS, rng.randint(1, 4)))
        question = f"{who} {rng.choice(QUESTIONS).format(**fill)} {details}"
    else:
        question = rng.choice(FOLLOW_UPS).format(**fill)
    lengths, weights = zip(*spec.output_lengths, strict=True)
    temperature = rng.choice([0.0, 0.3, 0.7, 0.7, 0.8, 1.0])
    stop_draw = rng.random()
    stop = (
        STOPS[0]
        if stop_draw < 0.3
        else STOPS[1]
        if stop_draw < 0.45
        else STOPS[2]
        if stop_draw < 0.5
        else None
    )
    return Turn(
        question=question,
        delay_s=0.0 if k == 0 else rng.expovariate(1 / spec.think_s) if spec.think_s > 0 else 0.0,
        max_tokens=rng.choices(lengths, weights)[0],
        temperature=temperature,
        top_p=rng.choice([1.0, 0.95, 0.9]),
        stop=stop,
        seed=rng.randrange(2**31) if temperature > 0 else None,
    )


def tokenizer_counter(model: str | None = None) -> Callable[[str], int]:
    """Token counts by the served model's tokenizer (the embedded model's when ``model`` is None)."""
    from hydragen.model.default_model import default_model_path
    from hydragen.model.tokenizer import load_tokenizer

    tok = load_tokenizer(model or default_model_path())
    return lambda text: len(tok.encode(text, add_special_tokens=False))
