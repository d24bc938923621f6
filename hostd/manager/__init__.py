"""The manager (hostd.service, org.hostd1): service.py is the D-Bus surface
(describe and dispatch), reload.py the reload state machine and its crash
recovery, records.py its records on disk, errors.py its refusals and their
D-Bus errors, api.py the names it shares with clients, systemd1.py its
systemd client, probe.py how it looks at a model's processes."""
