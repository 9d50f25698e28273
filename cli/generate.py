"""`tscale-peer infer` and `tscale-peer serve`: their flags, and the loops that drive the engine."""

from __future__ import annotations

import argparse
import sys
import time

from tscale_p2p.errors import UserError
from tscale_p2p.device import PRECISION_CHOICES


def add_infer_parser(commands) -> None:
    infer = commands.add_parser(
        "infer",
        help="generate text from a checkpoint or a live swarm",
        description="Generate text from a checkpoint (or the swarm's current model), streamed as it is produced, "
        "with tokens/s at the end. Without --prompt: an interactive prompt (or, when stdin is not a terminal, "
        "all of stdin as one prompt).",
    )
    _add_model_flags(infer)
    infer.add_argument("--prompt", help="text to continue (default: ask for it)")
    infer.add_argument("--max-tokens", type=int, default=256, metavar="N",
                       help="tokens to generate at most (default: 256)")
    infer.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy (default: 0.8)")
    infer.add_argument("--top-k", type=int, default=0, metavar="K",
                       help="sample among the K likeliest; 0 = off (default)")
    infer.add_argument("--top-p", type=float, default=1.0, metavar="P",
                       help="nucleus sampling mass in (0, 1] (default: 1)")
    infer.add_argument("--seed", type=int, help="makes sampling reproducible")
    infer.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before this text (repeatable)")
    infer.set_defaults(handler=run_infer)


def add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a checkpoint (or a live swarm's model) over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions (streaming too), /v1/models and /health. Requests that arrive "
        "together are generated as one batch.",
    )
    _add_model_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--max-batch", type=int, default=8, metavar="N", help="sequences generated at once (default: 8)")
    serve.set_defaults(handler=run_serve)


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("model source (one of)")
    source.add_argument("--checkpoint", metavar="DIR",
                        help="a run directory (its newest checkpoint) or one step-* directory")
    source.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                        help="fetch the swarm's current model from a live peer, through these multiaddrs")
    source.add_argument("--run-id", metavar="NAME",
                        help="with --initial-peers: which run (default: tscale, as for join)")
    source.add_argument("--fetch-timeout", type=float, default=60.0, metavar="S",
                        help="with --initial-peers: give up after S seconds without the model (default: 60)")
    parser.add_argument("--precision", choices=PRECISION_CHOICES, default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--index", metavar="DIR",
                        help="the index the model was trained with (tscale-peer index build), for a model with an index input")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="skip torch.compile / CUDA graphs (faster start, slower decoding)")


def _load_model(args: argparse.Namespace):
    """(model ready for inference, its name) from --checkpoint, or from a live swarm peer (--initial-peers)."""
    from tscale_p2p.generate import load_model, prepare_for_inference

    if (args.checkpoint is None) == (not args.initial_peers):
        raise UserError("give exactly one of --checkpoint DIR and --initial-peers MADDR... (with --run-id NAME)")
    if args.checkpoint is not None:
        if args.run_id is not None:
            raise UserError("--run-id goes with --initial-peers, not with --checkpoint")
        return load_model(args.checkpoint, args.device, args.precision)
    # The swarm is imported only here: a checkpoint needs no network stack (hivemind, p2pd) loaded.
    from tscale_p2p.cli.swarm import DEFAULT_RUN_ID
    from tscale_p2p.peers.fetch import fetch_swarm_model
    from tscale_p2p.peers.network import parse_multiaddrs
    from tscale_p2p.peers.run_config import check_run_id

    initial_peers = parse_multiaddrs(args.initial_peers, "--initial-peers", need_peer_id=True)
    run_id = check_run_id(args.run_id or DEFAULT_RUN_ID)
    if not args.fetch_timeout > 0:
        raise UserError(f"--fetch-timeout must be positive, got {args.fetch_timeout}")
    try:
        fetched = fetch_swarm_model(initial_peers, run_id, args.fetch_timeout)
    except KeyboardInterrupt:  # the network processes ignore Ctrl+C; fetch_swarm_model has shut them down
        print(f"tscale-peer: interrupted while fetching run {run_id!r}'s model", file=sys.stderr)
        raise SystemExit(130) from None
    return prepare_for_inference(fetched.build(), args.device, args.precision), run_id


def _open_index(args: argparse.Namespace, model):
    """--index, checked against the model's index input (or None for a model without one)."""
    if args.index is None and model.cfg.index is None:
        return None
    from tscale_p2p.index import TokenIndex, check_index_flag

    check_index_flag(model.cfg.index, args.index, "the model")
    return TokenIndex.open(args.index)


def run_infer(args: argparse.Namespace) -> int:
    from tscale_p2p.generate import GenerationEngine, SamplingParams, generate

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, stop=tuple(args.stop),
    )
    model, _ = _load_model(args)
    engine = GenerationEngine(model, slots=1, compile=None if args.compile else False, index=_open_index(args, model))

    def complete(prompt: str) -> None:
        started = time.perf_counter()
        [seq] = generate(engine, [prompt], params, on_text=lambda _, text: print(text, end="", flush=True))
        prefill_ms = (seq.first_token_at - started) * 1e3
        print(
            f"\n[{len(seq.tokens)} tokens, {seq.decode_tokens_per_second():.1f} tokens/s; prompt {len(seq.prompt)} "
            f"tokens in {prefill_ms:.0f} ms; stopped by {seq.finish_reason}]",
            file=sys.stderr,
        )

    if args.prompt is not None:
        complete(args.prompt)
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
    from tscale_p2p.generate import GenerationEngine
    from tscale_p2p.serve import CompletionServer

    if not 0 <= args.port <= 65535:
        raise UserError(f"port must be in 0..65535, got {args.port}")
    model, model_id = _load_model(args)
    engine = GenerationEngine(
        model, slots=args.max_batch, compile=None if args.compile else False, index=_open_index(args, model)
    )
    server = CompletionServer(engine, model_id, args.host, args.port)
    print(f"serving {model_id!r} at {server.url}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.service.stop()
        server.server_close()
    return 0
