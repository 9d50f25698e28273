"""Everything that crosses the network: DHT swarm, 1-bit codec, averaging, state sync, metrics."""
