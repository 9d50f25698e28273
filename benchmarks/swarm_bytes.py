"""Bytes on the wire per averaging round, the swarm's codecs vs hivemind's; block-size sweep.

    python benchmarks/swarm_bytes.py wire [--dims e768h12d18w1024] [--peers 4]
    python benchmarks/swarm_bytes.py live [--dims e256h4d8w256] [--peers 2] [--rounds 2] [--codec topk]
    python benchmarks/swarm_bytes.py blocks --data PATH/tinyshakespeare.txt
    python benchmarks/swarm_bytes.py groups [--dims e128h4d4w256 e768h12d12w1024] [--peers 2 3 4 8 16] [--codec topk]

`wire`: one round of hivemind's butterfly all-reduce among `--peers` peers with equal bandwidth, for the
tensor shapes of the given model (built on the meta device: no memory, no weights). Every message a peer
sends and receives is built for real: hivemind's `TensorPartContainer` splits the tensors into parts exactly
as an all-reduce does, each part is compressed by the codec, wrapped in the `AveragingData` protobuf that
goes on the stream, and measured with `ByteSize()`. Codec output sizes do not depend on the values, so each
distinct part size is compressed once. Not counted: libp2p framing (yamux, noise), the same for every codec.
Return trip: hivemind sends `average - own part` compressed with the sender's codec; SwarmAverager sends one
message per part, the same to every sender, in the codec's return form (sign: the same 1-bit code; topk: 256
values a chunk instead of 64).

`live`: the same count from the other end: real SwarmAverager peers (hivemind DHT + p2pd on 127.0.0.1) run
averaging rounds on random pseudo-gradients of the model's shapes, and each reports the tensor bytes it put on
and took off the wire (`RoundOutcome.bytes_sent` / `bytes_received`, protobuf level) and the round time.

`groups`: a swarm codec's budget at every group size, counted as `wire` counts it: bits per value of one trip
(a sender's part to its reducer, the reducer's answer), and a peer's whole uplink and downlink per round in bits
per parameter of the model. A peer makes both trips: it sends (n-1)/n of the model to the other reducers and
answers its own 1/n span to each of the n-1 others, so its uplink per round is 2(n-1)/n times the per-trip rate.

`blocks`: relative L2 error of sign x block-scale on a real pseudo-gradient (a small model trained a few
AdamW steps on the given text), for several block sizes and scale dtypes, with the bits per value each costs.

The pack kernel's speed on a GPU is measured by `benchmarks/onebit_pack.py`.
"""

from __future__ import annotations

import argparse
import time

import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionInfo, Float16Compression, Uniform8BitQuantization
from hivemind.proto import averaging_pb2

from tscale_p2p.kernels.onebit import pack, unpack
from tscale_p2p.model import ModelConfig, Transformer
from tscale_p2p.peers.codec import BLOCK_SIZE, CODECS, OneBitCodec, TopKCodec
from tscale_p2p.peers.hivemind_seam import parts_sent_to
from tscale_p2p.peers.settings import DEFAULT_CODEC
from tscale_p2p.peers.span_agreement import SIGNATURE_BYTES, signature_message

HIVEMIND_PART_SIZE_BYTES = 2**19  # hivemind's default
ONEBIT_PART_SIZE_BYTES = 2**17  # SwarmAverager's default: 2**20 values per part


def model_shapes(dims: str) -> list[torch.Size]:
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dims(dims))
    return [p.shape for p in model.parameters()]


def round_bytes(shapes, codec, part_size_bytes: int, peers: int) -> dict[str, float]:
    """Bytes peer 0 sends and receives in one all-reduce round, and bits per value of each trip's messages."""
    tensors = [torch.empty(shape) for shape in shapes]  # values do not matter for sizes; see module docstring
    infos = [CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors)]
    container = TensorPartContainer(tensors, [1.0] * peers, codec, part_size_bytes, infos)
    message_sizes: dict[int, tuple[int, int]] = {}

    def sizes(numel: int) -> tuple[int, int]:
        """(sender -> reducer message, reducer -> sender message) bytes for a part of `numel` values."""
        if numel not in message_sizes:
            info = CompressionInfo.from_tensor(torch.empty(numel))
            part = codec.compress(torch.randn(numel), info)
            # SwarmAverager's reducer answers in the codec's return form; hivemind's codecs answer in their own
            answer = getattr(codec, "return_trip", codec).compress(torch.randn(numel), info)
            up = averaging_pb2.AveragingData(tensor_part=part, weight=1000.0).ByteSize()
            down = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=answer).ByteSize()
            message_sizes[numel] = (up, down)
        return message_sizes[numel]

    # the first message of each stream also carries its code and the 20-byte group id; each answer stream ends
    # with the reducer's signature of its span
    stream_header = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=bytes(20)).ByteSize()
    signed = isinstance(codec, (OneBitCodec, TopKCodec))  # SwarmAverager's; hivemind's runner signs nothing
    signature = signature_message(bytes(SIGNATURE_BYTES)).ByteSize() if signed else 0
    sent = received = 0
    for reducer in range(1, peers):  # peer 0 sends its parts of the other spans and gets their averages back
        sent, received = sent + stream_header, received + signature
        for part in parts_sent_to(container, reducer):
            up, down = sizes(part.numel())
            sent, received = sent + up, received + down
    received += (peers - 1) * stream_header  # peer 0 reduces its own span: every other peer streams to it
    sent += (peers - 1) * signature
    for part in parts_sent_to(container, 0):
        up, down = sizes(part.numel())
        received, sent = received + (peers - 1) * up, sent + (peers - 1) * down
    all_parts = [part.numel() for reducer in range(peers) for part in parts_sent_to(container, reducer)]
    values = sum(all_parts)
    return dict(
        sent=sent,
        received=received,
        up_bits=8 * sum(sizes(n)[0] for n in all_parts) / values,
        down_bits=8 * (sum(sizes(n)[1] for n in all_parts) + peers * signature) / values,
    )


def wire(args) -> None:
    shapes = model_shapes(args.dims)
    numel = sum(s.numel() for s in shapes)
    codecs = [
        ("Float16 (hivemind)", Float16Compression(), HIVEMIND_PART_SIZE_BYTES),
        ("Uniform8Bit (hivemind)", Uniform8BitQuantization(), HIVEMIND_PART_SIZE_BYTES),
        (f"TopKCodec, k {TopKCodec().k}/{TopKCodec().return_k} (ours)", TopKCodec(), ONEBIT_PART_SIZE_BYTES),
        (f"OneBitCodec, block {BLOCK_SIZE} (ours)", OneBitCodec(), ONEBIT_PART_SIZE_BYTES),
    ]
    print(f"model {args.dims}: {numel / 1e6:.1f}M parameters in {len(shapes)} tensors, {args.peers} peers, one round")
    print(
        f"{'codec':<30} {'up bits/value':>13} {'down bits/value':>15} {'peer sent MB':>13} {'peer recv MB':>13}"
        f" {'vs ours':>8}"
    )
    rows = [(name, round_bytes(shapes, codec, part_size, args.peers)) for name, codec, part_size in codecs]
    ours = rows[-1][1]["sent"]
    for name, row in rows:
        print(
            f"{name:<30} {row['up_bits']:>13.4f} {row['down_bits']:>15.4f} {row['sent'] / 1e6:>13.2f}"
            f" {row['received'] / 1e6:>13.2f} {row['sent'] / ours:>7.1f}x"
        )
    print(
        "up: a sender's part to its reducer; down: the reducer's answer. Bits per value carried, everything in\n"
        f"the protobuf message included. Per round a peer sends {args.peers - 1}/{args.peers} of the model up and"
        f" answers its own 1/{args.peers} span to each of the {args.peers - 1} others: "
        f"{2 * (args.peers - 1) / args.peers:.2f}x the model at each codec's rate."
    )


def groups(args) -> None:
    codec = CODECS[args.codec]()
    print(f"{codec!r}: bits per value of each trip, and a peer's traffic per round in bits per parameter")
    print(f"{'model':<16} {'params':>7} {'peers':>5} {'up trip':>8} {'down trip':>9} {'uplink/round':>12}"
          f" {'downlink/round':>14} {'trips x model':>13}")
    for dims in args.dims:
        shapes = model_shapes(dims)
        numel = sum(s.numel() for s in shapes)
        for peers in args.peers:
            row = round_bytes(shapes, codec, ONEBIT_PART_SIZE_BYTES, peers)
            print(f"{dims:<16} {numel / 1e6:>6.1f}M {peers:>5} {row['up_bits']:>8.4f} {row['down_bits']:>9.4f}"
                  f" {8 * row['sent'] / numel:>12.4f} {8 * row['received'] / numel:>14.4f}"
                  f" {2 * (peers - 1) / peers:>13.3f}")
    print("up/down trip: bits per value of one message kind, everything in the protobuf included; uplink/downlink:\n"
          "all bytes one peer sends/receives in a round x 8 / parameters (what the dashboard's averaging log shows\n"
          "as 'up b/p'); trips x model: 2(n-1)/n, the share of the model a peer sends in a round at the trip rate.")


def live(args) -> None:
    import hivemind

    from tscale_p2p.peers.averaging import SwarmAverager

    shapes = model_shapes(args.dims)
    numel = sum(s.numel() for s in shapes)
    print(f"model {args.dims}: {numel / 1e6:.1f}M parameters, {args.peers} peers on 127.0.0.1, {args.rounds} rounds")
    dhts, averagers = [], []
    try:
        for _ in range(args.peers):
            dhts.append(hivemind.DHT(start=True, initial_peers=dhts[0].get_visible_maddrs() if dhts else None))
        template = [torch.zeros(shape) for shape in shapes]
        averagers = [SwarmAverager(template, dht, prefix="bench", matchmaking_time=3.0, codec=CODECS[args.codec]())
                     for dht in dhts]
        print(f"{'round':>5} {'peer':>4} {'group':>5} {'sent MB':>8} {'recv MB':>8} {'sent bits/param':>16}"
              f" {'recv bits/param':>16} {'seconds':>8}")
        for round_number in range(args.rounds):
            grads = [[torch.randn(shape) * 1e-3 for shape in shapes] for _ in averagers]
            pending = [a.start_round(g, tokens=1000.0) for a, g in zip(averagers, grads)]
            for peer, outcome in enumerate(p.result() for p in pending):
                print(
                    f"{round_number:>5} {peer:>4} {outcome.group_size:>5} {outcome.bytes_sent / 1e6:>8.2f}"
                    f" {outcome.bytes_received / 1e6:>8.2f} {8 * outcome.bytes_sent / numel:>16.4f}"
                    f" {8 * outcome.bytes_received / numel:>16.4f} {outcome.seconds:>8.1f}"
                )
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def pseudo_gradient(data_path: str, steps: int = 50) -> torch.Tensor:
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_dims("e128h4d4w64"))
    data = torch.frombuffer(bytearray(open(data_path, "rb").read()[:300_000]), dtype=torch.uint8).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def train(n: int) -> None:
        for _ in range(n):
            starts = torch.randint(0, len(data) - 65, (16,))
            batch = torch.stack([data[s : s + 65] for s in starts])
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    train(100)  # past the first, atypical steps
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    train(steps)
    return before - torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def blocks(args) -> None:
    delta = pseudo_gradient(args.data)
    print(f"pseudo-gradient of {delta.numel()} values (50 AdamW steps of an e128h4d4w64 model)")
    print(f"{'block':>6} {'scale':>6} {'bits/value':>11} {'rel. L2 error':>14}")
    for block in (32, 64, 128, 256, 512, 1024, 4096):
        signs, scales = pack(delta, block)
        for scale_name, scale_bits, decoded_scales in (("bf16", 16, scales), ("fp32", 32, None)):
            if decoded_scales is None:  # fp32 scales: the exact block means
                blocks_view = torch.nn.functional.pad(delta, (0, -delta.numel() % block)).view(-1, block)
                counts = torch.full((blocks_view.shape[0],), float(block))
                counts[-1] = delta.numel() - (blocks_view.shape[0] - 1) * block
                exact = blocks_view.abs().sum(1) / counts
                decoded = torch.where(delta < 0, -1.0, 1.0) * exact.repeat_interleave(block)[: delta.numel()]
            else:
                decoded = unpack(signs, decoded_scales, delta.numel(), block)
            error = float((delta - decoded).norm() / delta.norm())
            print(f"{block:>6} {scale_name:>6} {1 + scale_bits / block:>11.4f} {error:>14.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    wire_parser = sub.add_parser("wire", help="bytes per round per peer, ours vs hivemind's codecs")
    wire_parser.add_argument("--dims", default="e768h12d18w1024", help="model dims (default: 128M parameters)")
    wire_parser.add_argument("--peers", type=int, default=4)
    live_parser = sub.add_parser("live", help="bytes per round reported by real SwarmAverager peers on loopback")
    live_parser.add_argument("--dims", default="e256h4d8w256", help="model dims (default: 6.4M parameters)")
    live_parser.add_argument("--peers", type=int, default=2)
    live_parser.add_argument("--rounds", type=int, default=2)
    live_parser.add_argument("--codec", choices=sorted(CODECS), default=DEFAULT_CODEC)
    groups_parser = sub.add_parser("groups", help="our codec's bits per trip and per round at several group sizes")
    groups_parser.add_argument("--dims", nargs="+", default=["e128h4d4w256", "e768h12d12w1024"])
    groups_parser.add_argument("--peers", nargs="+", type=int, default=[2, 3, 4, 8, 16])
    groups_parser.add_argument("--codec", choices=sorted(CODECS), default=DEFAULT_CODEC)
    blocks_parser = sub.add_parser("blocks", help="error vs block size on a real pseudo-gradient")
    blocks_parser.add_argument("--data", required=True, help="a text file (e.g. tinyshakespeare.txt)")
    args = parser.parse_args()
    started = time.perf_counter()
    dict(wire=wire, live=live, groups=groups, blocks=blocks)[args.mode](args)
    print(f"({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
