"""Control: the driver side of a run, whatever hosts the roles.

Owns the Controller (`controller`: the step loop, evaluation, checkpoints when due, the metrics row, how a run
ends), supervision of a role that died (`supervisor`: which roles are restarted, from which checkpoint, and
the error when they are not) and the watch on a run that stalls (`watchdog`: heartbeats, loop monitors and the
one-line report of where a role is blocked). It talks to roles only through async proxies (in-process objects
or Ray actors), so it never imports Ray, a role or an engine; it may import the configuration, the step
pipeline (`asyncrl.pipeline`), checkpoints, telemetry and the replay buffer's types. The deployments
(`asyncrl.deploy`) build the roles and hand them to it.
"""
