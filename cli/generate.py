"""`tscale-peer infer` and `tscale-peer serve`: their flags, and the loops that drive the engine."""

from __future__ import annotations

import argparse
import sys
import time
import typing

from pydantic.dataclasses import dataclass

from tscale_p2p.cli.network import LISTENING, NetworkSettings
from tscale_p2p.cli.options import Command, Loaded
from tscale_p2p.device import PRECISION_CHOICES
from tscale_p2p.errors import UserError
from tscale_p2p.settings import SECTION_CONFIG, option


@dataclass(config=SECTION_CONFIG)
class InferenceSettings:
    """The model to run (a checkpoint, or with --initial-peers the swarm's), and where."""

    checkpoint: str | None = option(None, "a run directory (its newest checkpoint) or one step-* directory",
                                    metavar="DIR")
    fetch_timeout: float = option(60.0, "with --initial-peers: give up after S seconds without the model",
                                  metavar="S", gt=0)
    precision: typing.Literal[PRECISION_CHOICES] = option("auto", "auto: bf16 on CUDA, fp32 on CPU")
    index: str | None = option(
        None, "the index the model was trained with (tscale-peer index build), for a model with an index input",
        metavar="DIR")
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    compile: bool = option(True, "torch.compile / CUDA graphs (--no-compile: faster start, slower decoding)")


@dataclass(config=SECTION_CONFIG)
class SamplingSettings:
    """What `infer` generates (checked by `SamplingParams`, as a served request's are)."""

    prompt: str | None = option(None, "text to continue (default: ask for it)")
    max_tokens: int = option(256, "tokens to generate at most", metavar="N")
    temperature: float = option(0.8, "0 = greedy", metavar="T")
    top_k: int = option(0, "sample among the K likeliest; 0 = off (default)", metavar="K")
    top_p: float = option(1.0, "nucleus sampling mass in (0, 1]", metavar="P")
    seed: int | None = option(None, "makes sampling reproducible")
    stop: tuple[str, ...] = option((), "stop before this text (repeatable)", metavar="TEXT", repeat=True)


@dataclass(config=SECTION_CONFIG)
class ServeSettings:
    """Where `serve` listens, and how many requests it generates at once."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on", ge=0, le=65535)
    max_batch: int = option(8, "sequences generated at once", metavar="N", ge=1)


# A model from the swarm: dial out only.
INFER = Command((("inference", InferenceSettings), ("network", NetworkSettings), ("sampling", SamplingSettings)),
                skip=LISTENING)
SERVE = Command((("inference", InferenceSettings), ("network", NetworkSettings), ("serve", ServeSettings)),
                skip=LISTENING)


def add_infer_parser(commands) -> None:
    infer = commands.add_parser(
        "infer",
        help="generate text from a checkpoint or a live swarm",
        description="Generate text from a checkpoint (or the swarm's current model), streamed as it is produced, "
        "with tokens/s at the end. Without --prompt: an interactive prompt (or, when stdin is not a terminal, "
        "all of stdin as one prompt).",
    )
    INFER.add_flags(infer)
    infer.set_defaults(handler=run_infer)


def add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a checkpoint (or a live swarm's model) over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions (streaming too), /v1/models and /health. Requests that arrive "
        "together are generated as one batch.",
    )
    SERVE.add_flags(serve)
    serve.set_defaults(handler=run_serve)


def _load_model(loaded: Loaded):
    """(model ready for inference, its name) from --checkpoint, or from a live swarm peer (--initial-peers)."""
    from tscale_p2p.generate import load_model, prepare_for_inference

    source, network = loaded["inference"], loaded["network"]
    if (source.checkpoint is None) == (not network.initial_peers):
        raise UserError("give exactly one of --checkpoint DIR and --initial-peers MADDR... (with --run-id NAME)")
    if source.checkpoint is not None:
        if "run_id" in loaded.chosen:
            raise UserError("--run-id goes with --initial-peers, not with --checkpoint")
        return load_model(source.checkpoint, source.device, source.precision)
    # The swarm is imported only here: a checkpoint needs no network stack (hivemind, p2pd) loaded.
    from tscale_p2p.peers.fetch import fetch_swarm_model

    try:
        fetched = fetch_swarm_model(network.initial_peers, network.run_id, source.fetch_timeout)
    except KeyboardInterrupt:  # the network processes ignore Ctrl+C; fetch_swarm_model has shut them down
        print(f"tscale-peer: interrupted while fetching run {network.run_id!r}'s model", file=sys.stderr)
        raise SystemExit(130) from None
    return prepare_for_inference(fetched.build(), source.device, source.precision), network.run_id


def _engine(source: InferenceSettings, model, slots: int):
    """The generation engine over `model`, with --index checked against the model's index input."""
    from tscale_p2p.generate import GenerationEngine

    index = None
    if source.index is not None or model.cfg.index is not None:
        from tscale_p2p.index import TokenIndex, check_index_flag

        check_index_flag(model.cfg.index, source.index, "the model")
        index = TokenIndex.open(source.index)
    return GenerationEngine(model, slots=slots, compile=None if source.compile else False, index=index)


def run_infer(args: argparse.Namespace) -> int:
    from tscale_p2p.generate import SamplingParams, generate

    loaded = INFER.load(args)
    sampling = loaded["sampling"]
    params = SamplingParams(
        max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
        top_p=sampling.top_p, seed=sampling.seed, stop=sampling.stop,
    )
    model, _ = _load_model(loaded)
    engine = _engine(loaded["inference"], model, slots=1)

    def complete(prompt: str) -> None:
        started = time.perf_counter()
        [seq] = generate(engine, [prompt], params, on_text=lambda _, text: print(text, end="", flush=True))
        prefill_ms = (seq.first_token_at - started) * 1e3
        print(
            f"\n[{len(seq.tokens)} tokens, {seq.decode_tokens_per_second():.1f} tokens/s; prompt {len(seq.prompt)} "
            f"tokens in {prefill_ms:.0f} ms; stopped by {seq.finish_reason}]",
            file=sys.stderr,
        )

    if sampling.prompt is not None:
        complete(sampling.prompt)
    elif not sys.stdin.isatty():
        complete(sys.stdin.read())
    else:
        print("Type a prompt and press Enter; Ctrl-C stops a generation, Ctrl-D quits.", file=sys.stderr)
        while True:
            try:
                prompt = input(">>> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if not prompt:
                continue
            try:
                complete(prompt)
            except KeyboardInterrupt:
                engine.cancel()
                print("\n[stopped]", file=sys.stderr)
            except UserError as error:  # e.g. a prompt longer than the context: ask again
                print(f"error: {error}", file=sys.stderr)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from tscale_p2p.serve import CompletionServer

    loaded = SERVE.load(args)
    serve = loaded["serve"]
    model, model_id = _load_model(loaded)
    engine = _engine(loaded["inference"], model, slots=serve.max_batch)
    server = CompletionServer(engine, model_id, serve.host, serve.port)
    print(f"serving {model_id!r} at {server.url}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.service.stop()
        server.server_close()
    return 0
