"""The manager (hostd.service, org.hostd1): service.py is the D-Bus surface,
reload.py the reload state machine, systemd1.py its systemd client, probe.py
how it looks at a model's processes."""
