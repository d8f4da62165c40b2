"""Planning: `asyncrl plan`'s prediction of throughput, busy shares and staleness for other settings (generator
counts, staleness bounds, CPU layouts) from one finished run.

Owns the calibration of a finished run into costs (`planner.calibrate`), the model that predicts from them
(`model`: a discrete-event simulation of the runtime's protocol and a closed form) and the table and
recommendation `asyncrl plan` prints. It reads run directories (config, metrics, trace) and may import the
configuration, telemetry and `asyncrl.deploy.auto`'s thread layouts; nothing below it (roles, buffers, engines,
transports) imports it, and it starts no Ray and no role.
"""
