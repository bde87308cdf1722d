"""Does another client's traffic, or a prompt-cache hit, change a greedy answer on llama-server as people start it?

An operator's question, per item, on ``llama-server -m MODEL`` with the server's own defaults (slots auto, one
unified KV cache, flash attention auto, the host prompt cache on with idle-slot caching, the default context;
only ``--host``/``--port`` are given), then on each switch an operator can turn, one at a time. For each server
and item, three greedy requests of the item's prompt (token ids from a ledger's prompts table), each returning
the top two pre-sampling log-probabilities at every step:

- **alone**: sent when nothing else is in flight, without prompt reuse (``cache_prompt`` false), twice: the
  second is the A/A control and must give the first's tokens;
- **amid load**: three other clients each send one other item (the next items by id), their arrivals drawn
  from a seeded uniform schedule over [-L, L] seconds around the item's own arrival, L being the item's alone
  latency: some are generating when it arrives, some arrive while it runs;
- **prompt-cache hit**: the item sent with ``cache_prompt``, then the next two items, then the item again with
  ``cache_prompt``: the server reuses its cached prompt (from the slot or the host cache; ``timings.cache_n``).

Each is compared with the item's alone answer on the same server: served differently x/N items, and at the first
divergent step the top-1 minus top-2 log-probability margin of both (in logits: two log-probabilities of one
softmax differ by the logits' difference). Tokens per second: generated tokens over wall time, alone and amid
load. The server's own ``/props`` (slots, context per slot) and its flash attention (as given, or auto) are
printed per server. The mechanism behind a difference is E6's (docs/findings.md, "Through llama-server itself").

    python bench/deployed_server.py ledger/factors-llamaserver --items 32
    python bench/deployed_server.py ledger/factors-llamaserver --items 8 --servers default no-kv-unified
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq

from stagereplay.engines.llamaserver.client import GREEDY
from stagereplay.engines.llamaserver.process import ServerProcess
from stagereplay.experiments.compare import first_divergence
from stagereplay.inputs.checkpoints import read_model_record

# Each server an operator can start, as the flags given beside the model (default: none, the server's own).
SERVERS = {
    "default": [],
    "no-kv-unified": ["--no-kv-unified"],
    "np-1": ["-np", "1"],
    "q8_0-cache": ["-ctk", "q8_0", "-ctv", "q8_0"],
    "fa-off": ["-fa", "off"],
}
CLIENTS = 3  # other clients amid which the item is served
# The one flag every server here is given beyond the model: without it, the server's default extra CPU buffer
# types (weight repacking, AMX) crashed it at start on the embedded Q4_1 GGUF on an AMX CPU (SIGSEGV, seen here),
# as they crash the binding (engines/llamacpp/engine.py). The table names it on every row.
BASE_FLAGS = ["--no-repack"]


class DeployedServer(ServerProcess):
    """A llama-server started as people start it: the model, the address, and only the flags given."""

    def __init__(self, model: Path, flags: list[str]):
        super().__init__(model, start_timeout=300.0)
        self.flags = BASE_FLAGS + flags

    def command(self, port: int) -> list[str]:
        return [str(self.binary), "--model", str(self.model), "--host", "127.0.0.1", "--port", str(port), *self.flags]


@dataclasses.dataclass
class Answer:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 log-probability at each step
    seconds: float
    reused: int = 0  # prompt positions the server took from its cache (timings.cache_n)


@dataclasses.dataclass
class ItemResult:
    alone: Answer
    control: Answer
    loaded: Answer
    hit: Answer


def ask(server: ServerProcess, prompt: list[int], budget: int, cache_prompt: bool) -> Answer:
    """One greedy request; no slot named (the server picks one, as for any client)."""
    start = time.monotonic()
    payload = {
        "prompt": prompt,
        "n_predict": budget,
        "cache_prompt": cache_prompt,
        "n_probs": 2,
        "return_tokens": True,
        **GREEDY,
    }
    answer = server.request("/completion", payload)
    seconds = time.monotonic() - start
    steps = answer.get("completion_probabilities", [])
    margins = [step["top_logprobs"][0]["logprob"] - step["top_logprobs"][1]["logprob"] for step in steps]
    return Answer(list(answer["tokens"]), margins, seconds, int(answer.get("timings", {}).get("cache_n", 0)))


def amid_load(server, prompt, others: list[list[int]], budget: int, latency: float, rng: random.Random) -> Answer:
    """The item's request with ``others`` sent by their own clients on a seeded schedule around its arrival."""
    offsets = sorted(rng.uniform(-latency, latency) for _ in others)
    start = time.monotonic() - min(0.0, offsets[0])  # the earliest arrival at time 0
    result: dict[str, Answer] = {}
    errors: list[BaseException] = []

    def client(name: str, tokens: list[int], at: float) -> None:
        time.sleep(max(0.0, start + at - time.monotonic()))
        try:
            result[name] = ask(server, tokens, budget, cache_prompt=False)
        except BaseException as error:  # reported below, in the main thread
            errors.append(error)

    threads = [
        threading.Thread(target=client, args=(f"other-{i}", o, t)) for i, (o, t) in enumerate(zip(others, offsets))
    ]
    threads.append(threading.Thread(target=client, args=("item", prompt, 0.0)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return result["item"]


# What flash attention is when -fa is not given: auto, resolved at start; the server's default log does not say
# to what (llama.cpp's own lines are not shown at its default verbosity), nor does /props.
FLASH_ATTN_AUTO = "auto (not in the default log or /props)"


def measure(gguf: Path, flags: list[str], prompts: dict[str, list[int]], budget: int, seed: int) -> dict:
    order = sorted(prompts)
    results: dict[str, ItemResult] = {}
    with DeployedServer(gguf, flags) as server:
        props = server.request("/props")
        for index, item in enumerate(order):
            prompt = prompts[item]
            others = [prompts[order[(index + k) % len(order)]] for k in range(1, CLIENTS + 1)]
            alone = ask(server, prompt, budget, cache_prompt=False)
            control = ask(server, prompt, budget, cache_prompt=False)
            loaded = amid_load(server, prompt, others, budget, alone.seconds, random.Random(f"{seed}:{item}"))
            ask(server, prompt, budget, cache_prompt=True)
            for other in others[:2]:
                ask(server, other, budget, cache_prompt=True)
            hit = ask(server, prompt, budget, cache_prompt=True)
            results[item] = ItemResult(alone, control, loaded, hit)
    settings = props.get("default_generation_settings", {})
    return {
        "flags": BASE_FLAGS + flags,
        "slots": props.get("total_slots"),
        "n_ctx_per_slot": settings.get("n_ctx"),
        "flash_attn": flags[flags.index("-fa") + 1] if "-fa" in flags else FLASH_ATTN_AUTO,
        "build": props.get("build_info"),
        "items": results,
    }


def differs(results: dict[str, ItemResult], which: str) -> list[tuple[str, int]]:
    """The items whose ``which`` answer parts from their alone answer, with the first divergent step."""
    found = []
    for item, result in results.items():
        step = first_divergence(getattr(result, which).tokens, result.alone.tokens)
        if step is not None:
            found.append((item, step))
    return found


def margin_text(results: dict[str, ItemResult], flips: list[tuple[str, int]], which: str) -> str:
    pairs = [
        (results[item].alone.margins[step], getattr(results[item], which).margins[step])
        for item, step in flips
        if step < len(results[item].alone.margins) and step < len(getattr(results[item], which).margins)
    ]
    if not pairs:
        return "—"
    alone = statistics.median(a for a, _ in pairs)
    served = statistics.median(b for _, b in pairs)
    return f"{alone:.3g} / {served:.3g}"


def rate(results: dict[str, ItemResult], which: str) -> float:
    answers = [getattr(result, which) for result in results.values()]
    return sum(len(a.tokens) for a in answers) / sum(a.seconds for a in answers)


def table(measured: dict[str, dict]) -> str:
    lines = [
        "| server | slots | ctx/slot | flash attn | alone A/A identical | amid load: served differently | margin at"
        " the flip (alone / served) | cache hit: served differently | positions reused (median) | tokens/s alone"
        " | tokens/s amid load (the item's) |",
        "|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, level in measured.items():
        results = level["items"]
        n = len(results)
        control = n - len(differs(results, "control"))
        loaded, hit = differs(results, "loaded"), differs(results, "hit")
        reused = statistics.median(result.hit.reused for result in results.values())
        lines.append(
            f"| {name} {' '.join(level['flags'])} | {level['slots']} | {level['n_ctx_per_slot']} |"
            f" {level['flash_attn']} | {control}/{n} | {len(loaded)}/{n} | {margin_text(results, loaded, 'loaded')} |"
            f" {len(hit)}/{n} | {reused:g} | {rate(results, 'alone'):.1f} | {rate(results, 'loaded'):.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledger", type=Path, help="a llama.cpp or llamaserver ledger: its GGUF and prompts")
    parser.add_argument("--items", type=int, default=32)
    parser.add_argument("--budget", type=int, default=48, help="greedy tokens per request")
    parser.add_argument("--seed", type=int, default=0, help="the load schedule's seed")
    parser.add_argument("--servers", nargs="+", choices=sorted(SERVERS), default=list(SERVERS))
    parser.add_argument("--json", type=Path, help="also write every answer here")
    args = parser.parse_args(argv)
    records = sorted((args.ledger / "models").glob("*/model.json"))
    if not records:
        print(f"{args.ledger}: no model record — run a llama.cpp or llamaserver config there first")
        return 1
    record = read_model_record(records[0])
    if "gguf" not in record:
        print(f"{records[0]}: not a GGUF model record — give a llama.cpp or llamaserver ledger")
        return 1
    checkpoint = records[0].parent.name
    rows = pq.read_table(args.ledger / "prompts" / f"{checkpoint}.parquet").to_pylist()
    prompts = {row["item_id"]: list(row["prompt_tokens"]) for row in sorted(rows, key=lambda r: r["item_id"])}
    prompts = dict(list(prompts.items())[: args.items])
    measured = {
        name: measure(Path(record["gguf"]), SERVERS[name], prompts, args.budget, args.seed) for name in args.servers
    }
    print(f"{len(prompts)} items of {args.ledger}, {args.budget} greedy tokens each, load schedule seed {args.seed}")
    print(table(measured))
    if args.json:
        answers = {
            name: {**level, "items": {item: dataclasses.asdict(result) for item, result in level["items"].items()}}
            for name, level in measured.items()
        }
        args.json.write_text(json.dumps(answers, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
