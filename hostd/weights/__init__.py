"""The weight cache: a daemon that holds a checkpoint and shares it zero-copy
(protocol.py is the wire contract, shared.py the memory, daemon.py the process,
client.py the engine's side)."""
