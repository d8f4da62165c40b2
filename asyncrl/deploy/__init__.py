"""Deployment: building a run's roles from its config and hosting them, in one process or as Ray actors.

Owns turning the config into engines, roles and the buffer (`build`), where each role runs (`placement`:
devices, GPUs, the weight backend), the machine-dependent defaults of `[cluster]` (`auto`: CPUs, torch
threads, pinning, where the scorers run) and the tuner that measures thread counts (`thread_tuner`), the Ray
actor that hosts any role and the proxy that calls it (`actors`), and the two deployments the Controller runs
on: Ray (`launch`: cluster start, actors, the weight group, restarts) and one process (`local`). Only
`actors` and `launch` import Ray. It sits above the roles, the Controller (`asyncrl.control`), checkpoints,
engines and transports, and imports any of them; nothing below it imports it.
"""
