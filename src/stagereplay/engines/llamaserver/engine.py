"""The llama-server engine: a GGUF run by llama.cpp's own HTTP server, one server process per job.

The server is built from the llama.cpp tree the binding vendors (``llamaserver.build``), and started with
every setting the numbers depend on given on its command line, as ``llamaserver.reference`` lists them, no
warm-up decode, and an environment with every ``LLAMA_ARG_*`` removed (``llamaserver.process``). The server's stop at the job's end
goes with the job's process.

The engine's cache is the server's slot 0, named by the token list the slot holds (``ServerCache``).
Every request sends token ids only and is greedy (``GREEDY``), with the slot's tokens as the start of its
prompt, so the server keeps them (its prompt cache) and decodes only the new tokens: each answer's
``timings`` are checked to say exactly that (``cache_n`` kept, ``prompt_n`` decoded), so a recomputed prefix
can never pass unseen. After a request the slot holds its prompt and every generated token but the last,
which the server sampled and never decoded: the protocol's boundary state (cache over ``prefix[:-1]``,
the last token pending). ``snapshot`` saves the slot to a file and parses it with the binding's state
parser (``llamaserver.slots``); ``to_cache`` writes a state as a slot file and restores it into the
erased slot.

Logits: the server returns log-probabilities of the top ``n_probs`` tokens, computed from the raw float32
logits of that position before any sampler. ``forward`` asks for the whole vocabulary and returns that
row: the logits less one constant (their log-sum-exp), in float32, with tokens whose probability
underflows at ``-3.4028235e38``. Argmax, ties and differences of logits (margins, the readout's letter
margin) hold up to float32 rounding of exp, sum and log; absolute logits do not. ``generate`` (the
protocol's optional one-request decoding) takes each margin from the top two log-probabilities.

E6: the server takes flash attention, the micro-batch size, the cache types, the thread counts and its slot count
only on its command line, so ``reconfigure`` and ``use_threads`` restart it with them changed (a new context, as
the binding's ``reconfigure`` opens one; every earlier cache goes stale) and ``converted`` is the binding's
conversion (``llamacpp.state.converted_state``). Its ``batch`` is concurrent load: a server of B slots with one
unified cache (``load_slots``), B-1 other requests generating on slots 1.. while the engine's run on slot 0
(``in_flight``, ``llamaserver.load``); ``kv_unified`` off is the same load with one KV stream per slot
(``--no-kv-unified``). ``kv_offset`` is slot 1 holding an idle filler that slot 0's cells sit behind
(``behind_filler``).

Tokenizer, chat template, end-of-generation ids, geometry and vocabulary size are the binding's, read
from the same GGUF through a small context (the binding is installed with the server).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from stagereplay.engines.base import Engine, Environment, ModelError, Runtime
from stagereplay.engines.llamacpp.binding import PINNED_VERSION
from stagereplay.engines.llamacpp.cache_types import CacheTypeError, cache_types, check_cache_precision
from stagereplay.engines.llamacpp.engine import GgufCheckpoint, LlamaCppEngine, ggml_environment
from stagereplay.engines.llamacpp.settings import LLAMACPP_N_CTX, EngineSettings, check_runtime, chosen_rotation
from stagereplay.engines.llamacpp.state import SeqState, converted_state, part_format
from stagereplay.engines.llamaserver.batches import decode_calls, describe_split, prompt_calls
from stagereplay.engines.llamaserver.build import LlamaServerError, server_build
from stagereplay.engines.llamaserver.client import greedy_margin
from stagereplay.engines.llamaserver.load import companions_in_flight
from stagereplay.engines.llamaserver.process import ServerProcess, ServerSettings
from stagereplay.engines.llamaserver.reference import reference_settings, server_extra
from stagereplay.engines.llamaserver.sequences import SlotSequences, kept_positions
from stagereplay.engines.llamaserver.slots import read_slot_file, write_slot_file
from stagereplay.ledger.kvstate import KVState

# A JSON logprob of a token whose probability underflowed to 0 (the server's -FLT_MAX for JSON's lack of -inf).
UNDERFLOW = -3.4028234663852886e38
# The binding's ``reconfigure`` names the engine takes, each a restart with the matching option changed.
SETTING_NAMES = ("flash_attn", "ubatch", "cache_type", "n_threads", "load_slots", "kv_unified")
# The slot that holds a filler the engine's slot 0 sits behind (E6's kv_offset).
FILLER_SLOT = 1


class ServerCache:
    """Slot 0 of the engine's server, holding ``tokens`` (cells 0..n-1); stale once another cache starts."""

    def __init__(self, engine: LlamaServerEngine, generation: int, tokens: list[int]):
        self.engine, self.generation, self.tokens = engine, generation, tokens
        # What the slot really holds while a ``truncate`` waits for the next request (None: ``tokens``).
        self.slot_tokens: list[int] | None = None


class LlamaServerEngine(GgufCheckpoint, SlotSequences, Engine):
    """A GGUF served by one llama-server child process; its requests go to slot 0 (``attached_engine``: the same
    engine on one slot of a server someone else runs)."""

    @staticmethod
    def load_gguf(gguf: str | Path, runtime: Runtime) -> LlamaServerEngine:
        return load_llamaserver(gguf, runtime)

    def __init__(self, gguf_path: str | Path, settings: ServerSettings):
        gguf_path = Path(gguf_path)
        # The binding's vocabulary, template and geometry (a tiny context: no cache work happens there).
        self.binding = LlamaCppEngine(gguf_path, EngineSettings("fp16", 1, 1, 8))
        self.tokenizer = self.binding.tokenizer
        self.geometry = self.binding.geometry
        self.n_vocab = self.binding.n_vocab
        self.settings = settings
        # Two tokens that are one ASCII character each: a sampled token whose text is whole (``_forced``).
        self.plain_tokens = [self.tokenizer.encode(text, add_special_tokens=False)[0] for text in ("a", "b")]
        self.gguf_path = gguf_path
        self.slot_dir, self.server = self._new_server(settings)
        self.environment: Environment | None = None
        self.generation = 0
        self.saved = 0
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _new_server(self, settings: ServerSettings) -> tuple[Path, ServerProcess]:
        """The slot folder and the server the engine's requests go to: a process of its own, its slot files in a
        temporary folder (``attached_engine`` gives a server someone else runs instead)."""
        slot_dir = Path(tempfile.mkdtemp(prefix="stagereplay-slots-"))
        return slot_dir, ServerProcess(self.gguf_path, settings, slot_dir=slot_dir)

    def _start(self) -> None:
        """Start ``self.server`` and read the cache's rotation from its log; every earlier cache goes stale."""
        self.server.start()
        self.rotation = chosen_rotation([self.server.log_text()], cache_types(self.settings.cache_type), self.geometry)
        self.generation += 1

    # --- E6: settings a server takes only on its command line, so each change is a restart ---

    def reconfigure(self, **changes) -> None:
        """Run the next requests on a new server with these settings changed (the binding's ``reconfigure``
        names: ``flash_attn``, ``ubatch`` (0: the whole context), ``cache_type``, ``n_threads``; and ``load_slots``:
        B slots sharing one unified cache of B contexts, for concurrent load, 0 the reference's one slot). A restart
        even when nothing changes, as the binding opens a new context then: a control goes through the same
        path (a new process, its cache allocated anew) as its test level. Every cache of the old server is
        stale after it (``generation``); a saved state goes into the new one through ``to_cache``."""
        unknown = set(changes) - set(SETTING_NAMES)
        if unknown:
            raise ModelError(
                f"the llamaserver engine cannot change {', '.join(sorted(unknown))} by a restart — it changes"
                f" {', '.join(SETTING_NAMES)}"
            )
        fields = {}
        for name, value in changes.items():
            if name == "ubatch":
                fields["ubatch"] = value or LLAMACPP_N_CTX
            elif name == "n_threads":
                fields["threads"] = fields["threads_batch"] = value
            elif name == "load_slots":
                # Each slot may hold a whole context, so companions never crowd the cache (no batch retries); without
                # a unified cache each slot's stream gets an equal share of it: one whole context again.
                slots = max(value, 1)
                fields.update(
                    parallel=slots, kv_unified=value > 0, ctx_size=LLAMACPP_N_CTX * slots, log_batches=value > 0
                )
                if "kv_unified" in changes:
                    fields["kv_unified"] = value > 0 and changes["kv_unified"]
            elif name == "kv_unified":
                fields.setdefault("kv_unified", value)
            else:
                fields[name] = value
        settings = dataclasses.replace(self.settings, **fields)
        settings = dataclasses.replace(settings, extra=server_extra(settings.cache_type))
        try:
            for head_dim in {self.geometry.head_dim_k, self.geometry.head_dim_v}:
                check_cache_precision(settings.cache_type, settings.flash_attn, head_dim)
        except CacheTypeError as error:
            raise LlamaServerError(str(error)) from None
        self.server.stop()
        self.settings = settings
        self.server = ServerProcess(self.gguf_path, settings, slot_dir=self.slot_dir)
        self._start()

    def use_threads(self, threads: int) -> None:
        """The next requests on a new server with ``-t threads -tb threads`` (the server sets them only at start)."""
        self.reconfigure(n_threads=threads)

    def in_flight(self, prompts: list[list[int]], cancelled: bool = False):
        """A block with greedy requests for ``prompts`` generating on slots 1.. (``llamaserver.load``); with
        ``cancelled``, started, then cancelled and erased before the block (the load path's control)."""
        return companions_in_flight(self.server, prompts, cancelled=cancelled)

    @contextlib.contextmanager
    def behind_filler(self, tokens: list[int], removed: bool = False):
        """A server of two slots in one unified cache whose slot 1 holds ``tokens``: one request of that prompt, kept
        by the slot (the last generated token is never decoded) and left idle, so slot 0's cells come after them;
        ``--no-cache-idle-slots`` keeps an idle slot's cells in the cache. ``removed``: slot 1 erased at once."""
        self.reconfigure(load_slots=2)
        try:
            answer = self.server.complete(list(tokens), 1, slot=FILLER_SLOT, cache_prompt=True, n_probs=0)
            if answer.get("timings", {}).get("prompt_n") != len(tokens):
                raise LlamaServerError(f"llama-server decoded {answer.get('timings')} of a {len(tokens)}-token filler")
            if removed:
                self.server.erase_slot(FILLER_SLOT)
            yield
        finally:
            self.reconfigure(load_slots=0)

    def log_mark(self) -> int:
        """Where the running server's log ends now (``prompt_split`` reads from there)."""
        return self.server.log_size()

    def prompt_split(self, mark: int, positions: int) -> str:
        """How the server cut positions 0 .. ``positions`` - 1 of slot 0 into decode calls since ``mark``, from
        its batch log (a server under load logs every micro-batch: ``llamaserver.batches``). Read once, while the
        server runs: the log is written by a thread of its own, so a caller reads it a while after the prompt (after
        the request went on generating), and a log that does not hold every position says how many it holds."""
        calls = prompt_calls(decode_calls(self.server.log_since(mark)), 0, positions)
        logged = {position for call in calls for position in call.positions_of(0) if position < positions}
        split = describe_split(calls, 0, positions)
        return split if len(logged) == positions else f"{split} (the log holds {len(logged)} of {positions} positions)"

    def converted(self, state: KVState) -> KVState:
        """``state`` in this server's cache type, converted as the binding's engine converts it."""
        return converted_state(self.placed(state), self.settings.cache_type, self.formats)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.binding.eos_ids

    @property
    def num_layers(self) -> int:
        return self.geometry.n_layer

    @property
    def formats(self) -> tuple[str, str]:
        types = cache_types(self.settings.cache_type)
        return part_format(types.k, self.rotation[0]), part_format(types.v, self.rotation[1])

    def build_description(self) -> str:
        s = self.settings
        k_format, v_format = self.formats
        return (
            f"{server_build().describe()}; server: -c {s.ctx_size} -b {s.batch} -ub {s.ubatch} -np {s.parallel}"
            f" {'--kv-unified' if s.kv_unified else '--no-kv-unified'} -fa {'on' if s.flash_attn else 'off'}"
            f" cache={s.cache_type} -t {s.threads} -tb {s.threads_batch or s.threads}"
            f" {'--repack' if s.repack else '--no-repack'} --cache-ram {s.cache_ram_mib} {' '.join(s.extra)}"
            f" --no-warmup; K stored as {k_format or 'values'}, V as {v_format or 'values'}; weights as in the GGUF;"
            " logits read as log-probabilities (n_probs: logits less a constant per position)"
        )

    # The engine protocol (base.Engine).

    def empty_cache(self) -> ServerCache:
        self.server.erase_slot(self.slot)
        self.generation += 1
        return ServerCache(self, self.generation, [])

    def forward(self, tokens: list[int], cache: ServerCache) -> torch.Tensor:
        """The tokens decoded after the slot's in one request; the last position's log-probability row."""
        # The sampled token forced to a one-character one: a token ending inside a multi-byte character would
        # come back without probabilities (``_step``); they are read before any sampler, so the bias is not in them.
        answer = self._request(cache, tokens, n_predict=1, n_probs=self.n_vocab, logit_bias=self._forced(-1))
        row = torch.full((self.n_vocab,), UNDERFLOW, dtype=torch.float32)
        top = answer["completion_probabilities"][0]["top_logprobs"]
        if len(top) != self.n_vocab:
            raise LlamaServerError(f"llama-server returned {len(top)} log-probabilities, not the {self.n_vocab} asked")
        row[torch.tensor([entry["id"] for entry in top])] = torch.tensor(
            [entry["logprob"] for entry in top], dtype=torch.float32
        )
        return row

    def feed(self, tokens: list[int], cache: ServerCache) -> None:
        """The tokens decoded after the slot's, no log-probabilities sent back (the whole row is megabytes)."""
        self._request(cache, tokens, n_predict=1, n_probs=0)

    def generate(
        self,
        cache: ServerCache,
        tokens: list[int],
        max_new_tokens: int,
        eos_ids: Collection[int],
        *,
        stop_after: Callable[[list[int]], bool] | None = None,
    ) -> tuple[list[int], list[float], str]:
        """Greedy decoding in the server's own loop (see ``base.Engine.generate``): one request for the whole
        budget; or one request per token (each decodes the previous token alone, as the one-request loop does)
        with ``stop_after`` (a Python condition the server cannot evaluate), or where the one request came back
        without some token's probabilities (``_step``): then the slot is first put back as it was."""
        held = len(cache.tokens)
        if stop_after is None:
            answer = self._request(cache, tokens, n_predict=max_new_tokens, n_probs=2)
            generated = list(answer["tokens"])
            if len(answer.get("completion_probabilities", [])) == len(generated):
                stop = self._stop_of(generated, max_new_tokens, eos_ids)
                return (
                    generated,
                    [greedy_margin(token, step) for token, step in zip(generated, answer["completion_probabilities"])],
                    stop,
                )
            self._rewind(cache, held, tokens[0])
        generated, margins = [], []
        pending = list(tokens)
        while True:
            token, margin = self._step(cache, pending)
            generated.append(token)
            margins.append(margin)
            if token in eos_ids:
                return generated, margins, "eos"
            if stop_after is not None and stop_after(generated):
                return generated, margins, "stopped"
            if len(generated) >= max_new_tokens:
                return generated, margins, "budget"
            pending = [token]

    def _step(self, cache: ServerCache, tokens: list[int]) -> tuple[int, float]:
        """One greedy token after ``tokens`` and its margin. The server reports a token's probabilities only once
        the text generated so far is whole UTF-8: a token ending inside a multi-byte character comes back
        without them. Then the same request runs again on the slot as it was (``_rewind``: the same decode
        call at the same cells), its sampled token forced to a one-character one, which does not change the
        probabilities: they are read from the logits before any sampler. They must name the same token."""
        held = len(cache.tokens)
        answer = self._request(cache, tokens, n_predict=1, n_probs=2)
        token = answer["tokens"][0]
        if answer.get("completion_probabilities"):
            return token, greedy_margin(token, answer["completion_probabilities"][0])
        self._rewind(cache, held, tokens[0])
        answer = self._request(cache, tokens, n_predict=1, n_probs=2, logit_bias=self._forced(tokens[0]))
        return token, greedy_margin(token, answer["completion_probabilities"][0])

    def _forced(self, avoid: int) -> list[list[float]]:
        """A logit bias that makes the server sample a one-character token (other than ``avoid``)."""
        forced = self.plain_tokens[0] if self.plain_tokens[0] != avoid else self.plain_tokens[1]
        return [[forced, 1.0e6]]

    def _rewind(self, cache: ServerCache, held: int, avoid: int) -> None:
        """Make the next request on the slot keep exactly its first ``held`` cells and decode the rest anew: a
        one-token request puts another token at position ``held`` (so the slot's tokens part from the next
        prompt there), and the next request drops that cell before it decodes (the server's prompt cache)."""
        kept = cache.tokens[:held]
        cache.tokens = kept
        self._request(cache, [self._forced(avoid)[0][0]], n_predict=1, n_probs=0)
        cache.tokens = kept

    def snapshot(self, cache: ServerCache) -> KVState:
        self._check(cache)
        name = self.slot_file_name("snapshot")
        held = cache.tokens if cache.slot_tokens is None else cache.slot_tokens  # a truncation still pending
        answer = self.server.save_slot(self.slot, name)
        try:
            if answer.get("n_saved") != len(held):
                raise LlamaServerError(f"llama-server saved {answer.get('n_saved')} tokens, the slot holds {len(held)}")
            tokens, parsed = read_slot_file(self.slot_dir / name, self.geometry, self.slot, self.rotation)
        finally:
            (self.slot_dir / name).unlink(missing_ok=True)
        if tokens != held or parsed.kv.num_positions != len(held) or parsed.cache_type != self.settings.cache_type:
            raise LlamaServerError(
                f"llama-server's slot file holds {parsed.kv.num_positions} {parsed.cache_type} cells over other tokens than"
                f" the {len(held)} {self.settings.cache_type} cells the engine decoded"
            )
        return parsed.kv if len(held) == len(cache.tokens) else kept_positions(parsed.kv, len(cache.tokens))

    def to_cache(self, state: KVState) -> ServerCache:
        """A slot restored from ``state``, written as a slot file. The file's token list is the slot's record of
        what its cells hold, used only to match the next prompt: placeholders (token 0) stand for the unknown
        tokens of a stored state, and every later prompt starts with them."""
        state = self.placed(state)
        if state.formats != self.formats:
            raise LlamaServerError(
                f"a cache stored as {state.formats} cannot go into this {self.settings.cache_type} server (stores"
                f" {self.formats}) unconverted"
            )
        if state.num_layers != self.geometry.n_layer:
            raise LlamaServerError(
                f"a cache of {state.num_layers} layers cannot feed a model of {self.geometry.n_layer} layers — continue a"
                " state only on the model that built it"
            )
        cache = self.empty_cache()
        tokens = [0] * state.num_positions
        # Without a unified cache each slot has a KV stream of its own (slot i in stream i).
        streams = 1 if self.settings.kv_unified else self.settings.parallel
        seq = SeqState(
            kv=state,
            seq_id=self.slot,
            v_trans=not self.settings.flash_attn,
            cache_type=self.settings.cache_type,
            streams=streams,
            stream=self.slot if streams > 1 else 0,
        )
        name = self.slot_file_name("restore")
        write_slot_file(self.slot_dir / name, seq, tokens)
        try:
            answer = self.server.restore_slot(self.slot, name)
        finally:
            (self.slot_dir / name).unlink(missing_ok=True)
        if answer.get("n_restored") != len(tokens):
            raise LlamaServerError(f"llama-server restored {answer.get('n_restored')} tokens of {len(tokens)}")
        cache.tokens = tokens
        return cache

    # Requests.

    def _request(self, cache: ServerCache, tokens: list[int], *, n_predict: int, n_probs: int, **extra) -> dict:
        """One completion on the slot: ``tokens`` after what it holds, then ``n_predict`` greedy tokens; checked to
        have kept exactly the slot's tokens and decoded exactly the new ones (then the generated but the last)."""
        self._check(cache)
        if not tokens:
            raise LlamaServerError("a request must feed at least one token after the slot's")
        if len(cache.tokens) + len(tokens) + n_predict > self.settings.ctx_size:
            raise LlamaServerError(
                f"{len(cache.tokens) + len(tokens) + n_predict} positions exceed the server's context of {self.settings.ctx_size}"
            )
        prompt = cache.tokens + list(tokens)
        answer = self.server.complete(
            prompt, n_predict, slot=self.slot, cache_prompt=True, n_probs=n_probs, post_sampling_probs=False, **extra
        )
        timings = answer.get("timings", {})
        if timings.get("cache_n") != len(cache.tokens) or timings.get("prompt_n") != len(tokens):
            raise LlamaServerError(
                f"llama-server kept {timings.get('cache_n')} and decoded {timings.get('prompt_n')} prompt tokens, not the"
                f" slot's {len(cache.tokens)} and the {len(tokens)} new ones"
            )
        if answer.get("truncated"):
            raise LlamaServerError("llama-server truncated the prompt — raise the context")
        generated = list(answer.get("tokens", []))
        if not generated:
            raise LlamaServerError("llama-server generated no token")
        cache.tokens = prompt + generated[:-1]
        cache.slot_tokens = None
        self.fed_positions += len(tokens) + len(generated) - 1
        if answer.get("tokens_cached", len(cache.tokens)) != len(cache.tokens):
            raise LlamaServerError(
                f"llama-server's slot holds {answer['tokens_cached']} tokens, not {len(cache.tokens)}"
            )
        return answer

    @staticmethod
    def _stop_of(generated: list[int], max_new_tokens: int, eos_ids: Collection[int]) -> str:
        """Why a one-request generation ended, as ``decode_greedy`` decides it; the server's stop must agree."""
        if any(token in eos_ids for token in generated[:-1]):
            raise LlamaServerError("llama-server generated past an end-of-generation token")
        if generated[-1] in eos_ids:
            return "eos"
        if len(generated) != max_new_tokens:
            raise LlamaServerError(
                f"llama-server stopped after {len(generated)} of {max_new_tokens} tokens on no end token"
            )
        return "budget"

    def _check(self, cache: ServerCache) -> None:
        if cache.engine is not self or cache.generation != self.generation:
            raise LlamaServerError("a llama-server cache was used after its engine started another one")

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.slot_dir, ignore_errors=True)
        if self.binding is not None:
            self.binding.close()
            self.binding = None


def load_llamaserver(gguf: str | Path, runtime: Runtime) -> LlamaServerEngine:
    """A server for the GGUF at ``runtime`` (the precision is the cache type), with its environment record."""
    check_runtime(runtime, "llamaserver", "the llama-server engine")
    engine = LlamaServerEngine(gguf, reference_settings(runtime))
    engine.environment = environment_of(engine, runtime)
    return engine


def environment_of(engine: LlamaServerEngine, runtime: Runtime) -> Environment:
    build = server_build()
    return ggml_environment(
        "llamaserver",
        runtime.precision,
        engine.settings.threads,
        engine.settings.flash_attn,
        " ".join(build.cpu_features),
        f"llama-server {build.version_output} (llama.cpp {build.llama_cpp_commit} of llama-cpp-python {PINNED_VERSION})",
        engine.build_description(),
    )
