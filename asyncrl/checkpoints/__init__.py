"""Checkpoints: what a run leaves on disk to be resumed, and when it writes it.

Owns the format of a durable checkpoint (`store`: atomic, verified folders of safetensors + msgpack, the
optimizer, scheduler and RNG state helpers, the Hugging Face export), when one is due and the line a failed
run ends with (`policy`: `run.save_every`, `run.save_every_s`, the last good checkpoint and the resume
command), and the relay that moves checkpoints between the driver's node and a trainer on another node
(`transfer`). It may import torch, safetensors, msgspec and the run log's cause chain
(`asyncrl.telemetry.runlog`); it starts no Ray and imports no role: the Controller, the supervisor and the
trainer roles call it.
"""
