"""The gateway: the model's front door (server.py), its admission state
(state.py) and its control socket (control.py)."""
