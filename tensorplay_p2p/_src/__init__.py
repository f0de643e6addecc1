"""The package's internals, one folder per layer, each importing only the layers below it (docs/architecture.md):

- ``errors``, ``settings``: every message's wording and exception; the process-wide settings (leaves)
- ``engine``: which engine runs the hot path; the compiled one's C source
- ``memory``: tensors as MPI buffers (kinds, layouts, devices, DLPack, host pools)
- ``process``: this process in its job (start-up, process groups, the watchdog, signals, ranks that leave, the end)
- ``p2p``: point-to-point (the calls, their handles, argument checks, checked mode, profiler events)
- ``persistent``: persistent exchanges (``P2PPlan``, ``HaloExchange``, Cartesian groups)
- ``collectives``: the collectives (the calls, their handle, arguments, reductions, checks; the object ones)
- ``cli``: the ``tensorplay-p2p`` command

Nothing here is public: the names users import are re-exported by ``tensorplay_p2p`` and its public modules.
"""
