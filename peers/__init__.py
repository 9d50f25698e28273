"""Everything that crosses the network: DHT swarm, 1-bit codec, averaging, state sync, metrics."""

import warnings

# hivemind 1.1.12 applies torch.jit.script to two of its functions as it is imported, which recent torch releases
# deprecate with a FutureWarning: two lines naming torch's source file ahead of every `tscale-peer` message, about
# code that is hivemind's. Only that warning, raised from that torch module, is silenced.
warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning,
                        module=r"torch\.jit\._script")
