"""The manager (hostd.service, org.hostd1), one room per job:

    service.py       the org.hostd1.Manager object: discovery, verbs, operations on the bus
    model_bus.py     one org.hostd1.Model object per model
    operation_bus.py one org.hostd1.Operation object per operation
    authority.py     who may call a method (the caller's uid, polkit, @admin; @anyone for read-only ones)
    errors.py        its refusals and the one mapping to D-Bus errors
    api.py           the names it shares with clients
    operation.py     a reload's states, stages and allowed transitions
    patch.py         the checks a reload patch passes before anything reads it
    change.py        what a reload changes: the engine's limits, or the checkpoint
    reload.py        the reload's skeleton (validate, preflight, record, commit, rollback) and its one driver
    strategies/      the reload strategies, one file each (restart, overlap, standby, swap, in-place): stages, hooks, recovery
    preflight.py     whether a reload fits (memory by NVML) and which strategy runs it
    recovery.py      the end of a reload a crashed manager left half done
    dropins.py       the drop-in files a reload writes
    records.py       its records on disk (intent, committed config, operation ids)
    probe.py         how it looks at and steers a model's gateway, engine, weights and GPUs
    systemd1.py      its systemd client
    tasks.py         the one keeper of the tasks it starts and does not await
"""
