"""What every test tier plays episodes with: the sample bundle and its happy-path scripts, agent-env's real env
server in a subprocess (``serve_bundle``), and a scripted OpenAI-compatible model (``ScriptedModel``).

``local_tools_env`` (the env type giving each episode its own tool server) is imported only by the env server, and
``pytest_plugin`` only by pytest, so importing this package stays cheap.
"""

from .env_server import HeldOpen, LeftOpen, ServedBundle, ServerFailed, serve_bundle
from .loopback import Request
from .script import broken, delay, error, text, tool_call, tool_calls
from .scripted_model import ScriptedModel
from .scripts import REWARDS, SAMPLE_BUNDLE, SAMPLE_ENV, SCRIPTS, TASKS

__all__ = [
    "REWARDS",
    "SAMPLE_BUNDLE",
    "SAMPLE_ENV",
    "SCRIPTS",
    "TASKS",
    "HeldOpen",
    "LeftOpen",
    "Request",
    "ScriptedModel",
    "ServedBundle",
    "ServerFailed",
    "broken",
    "delay",
    "error",
    "serve_bundle",
    "text",
    "tool_call",
    "tool_calls",
]
