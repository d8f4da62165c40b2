"""Serving the policy to agent code that speaks the OpenAI API (docs/envs.md, "The OpenAI-compatible endpoint").

Place in the dataflow: beside `asyncrl.Runtime` — `rt.serve_openai()` starts an `OpenAIServer` whose requests
go to the Runtime's generators and are recorded per episode (`ServedEpisode`) for `rt.submit`.
"""

from asyncrl.serve.openai_server import OpenAIServer
from asyncrl.serve.recording import ServedEpisode

__all__ = ["OpenAIServer", "ServedEpisode"]
